"""ReLU attention (Wortsman et al., "Replacing softmax with ReLU in Vision Transformers",
2023): relu(q·k/√D) / n, with no normalisation over the keys, n the number of keys the
query may see (counting only the visible ones keeps a causal query's weights the same in
a full forward and in decoding)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.base import AttentionKernel, attention_mask, visible_keys


class ReLUAttention(AttentionKernel):
    """ReLU attention, ``relu(s q·k) / n v`` with rows that need not sum to 1.

    Args:
        scale: s; None means 1/sqrt(head_dim).
    """

    name = "relu"
    formula = "relu(q·k/√D) / n (not normalised)"
    normalized = False
    forms_scores = True

    def __init__(
        self, head_dim: int, num_heads: int, dropout: float = 0.0, scale: float | None = None
    ) -> None:
        super().__init__(head_dim, num_heads, dropout)
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}"

    def weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        allowed = attention_mask(
            q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
            device=q.device,
        )  # fmt: skip
        n = visible_keys(allowed, q.shape[2], k.shape[2], q.device).clamp(min=1).to(q.dtype)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        w = torch.relu(scores + self.score_bias(q.shape[2], k.shape[2], scores)) / n
        return w if allowed is None else w.masked_fill(~allowed, 0.0)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``max(0, s q·k) / n`` over the allowed pairs, in float64."""
        allowed = naive.pair_mask(q, k, causal, key_padding_mask)
        n = allowed.sum(-1, keepdim=True).double()
        scores = self.scale * naive.dot(q, k) + self.reference_bias(q.shape[2], k.shape[2])
        w = torch.clamp(scores, min=0.0) / torch.where(n > 0, n, 1.0)
        return torch.where(allowed, w, torch.zeros_like(w))
