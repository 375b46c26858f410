"""Pieces the models share: layer stacks, cache reordering, token sampling."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from transformers_lab.nn import Block, KernelFactory


def block_stack(
    n_layer: int,
    d_model: int,
    n_head: int,
    attention: KernelFactory | str,
    cross_attention: KernelFactory | str | None = None,
    **block_options: Any,
) -> nn.ModuleList:
    """``n_layer`` Blocks with the same options."""
    if n_layer < 1:
        raise ValueError(f"n_layer must be at least 1, got {n_layer}")
    return nn.ModuleList(
        Block(d_model, n_head, attention, cross_attention, **block_options) for _ in range(n_layer)
    )


def final_norm(d_model: int, bias: bool, norm_first: bool) -> nn.Module:
    """The LayerNorm after a pre-norm stack; post-norm stacks end normalised already."""
    return nn.LayerNorm(d_model, bias=bias) if norm_first else nn.Identity()


def reorder_cache(state: Any, index: Tensor) -> Any:
    """Select batch rows ``index`` of every tensor in a (nested) decoding cache."""
    if state is None:
        return None
    if isinstance(state, Tensor):
        return state.index_select(0, index)
    if not isinstance(state, (tuple, list)):  # a count (RoPE's position), the same for all
        return state
    return type(state)(reorder_cache(s, index) for s in state)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Refuse sampling options that draw nothing sensible (raises ``ValueError``)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no cut), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V).

    ``temperature=0`` is greedy. ``top_k`` keeps the k most likely tokens and ``top_p``
    the smallest set whose probability reaches p (nucleus sampling); both can be combined.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
