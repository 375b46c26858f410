"""ReLU attention (Wortsman et al., "Replacing softmax with ReLU in Vision Transformers",
2023): relu(q·k/√D) / n, with no normalisation over the keys, n the number of keys the
query may see (counting only the visible ones keeps a causal query's weights the same in
a full forward and in decoding)."""

from __future__ import annotations

import torch
from torch import Tensor

from transformers_lab.attention.keywise import KeywiseAttention


class ReLUAttention(KeywiseAttention):
    """ReLU attention, ``relu(s q·k) / n v`` with rows that need not sum to 1.

    Args:
        scale: s; None means 1/sqrt(head_dim).
    """

    name = "relu"
    formula = "relu(q·k/√D) / n (not normalised)"

    def activate(self, scores: Tensor, n: Tensor) -> Tensor:
        return torch.relu(scores) / n

    def reference_activate(self, scores: Tensor, n: Tensor) -> Tensor:
        """``max(0, s q·k) / n``."""
        return torch.clamp(scores, min=0.0) / n
