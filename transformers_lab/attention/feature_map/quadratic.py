"""The quadratic path: the explicit N x N polynomial matrix, the reference the linear
paths are checked against (and what ``weights`` returns)."""

from __future__ import annotations

from torch import Tensor

from transformers_lab.attention.feature_map.features import poly
from transformers_lab.attention.masks import attention_mask


def polynomial_matrix(q: Tensor, k: Tensor, p: int, allowed: Tensor | None) -> Tensor:
    """The explicit (B, H, Nq, Nk) matrix poly(q . k), zero where ``allowed`` is False."""
    a = poly(q @ k.transpose(-2, -1), p)
    return a if allowed is None else a.masked_fill(~allowed, 0.0)


def quadratic(q: Tensor, k: Tensor, v_aug: Tensor, p: int, causal: bool) -> Tensor:
    """Reference path: the explicit (B, H, Nq, Nk) polynomial times v_aug."""
    allowed = attention_mask(
        q.shape[2], k.shape[2], causal=causal, key_padding_mask=None, device=q.device
    )
    return polynomial_matrix(q, k, p, allowed) @ v_aug  # (B, H, Nq, Dv + 1)
