"""Optimiser helpers."""

from __future__ import annotations

from typing import Any

from torch import nn

_MATRIX_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: decay on the weights of linear and convolution layers, none
    on biases, norms, embeddings (position tables and class tokens included) and the
    kernels' own parameters.

    A weight tied to an embedding (GPT's LM head) counts as the embedding, and each tensor
    appears once even when it is shared.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, _MATRIX_MODULES) and id(m.weight) not in embeddings
    }
    params = [p for p in model.parameters() if p.requires_grad]  # a shared tensor once
    decay = [p for p in params if id(p) in matrices]
    no_decay = [p for p in params if id(p) not in matrices]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
