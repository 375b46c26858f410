"""Sigmoid attention (Ramapuram et al., "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention", 2024): each key is weighed on its own, sigma(q·k/√D + b), with no
normalisation over the keys, and b = -log n, n the number of keys the query may see (so
that the weights start out summing to about 1, as the paper advises). Counting only the
visible keys keeps a causal query's weights the same in a full forward and in decoding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.base import AttentionKernel, attention_mask, visible_keys


class SigmoidAttention(AttentionKernel):
    """Sigmoid attention, ``sigma(s q·k + b) v`` with rows that need not sum to 1.

    Args:
        scale: s; None means 1/sqrt(head_dim).
        bias: b; None means -log n, n the keys the query may see.
    """

    name = "sigmoid"
    formula = "σ(q·k/√D + b), b = −log n (not normalised)"
    normalized = False
    forms_scores = True

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: float | None = None,
    ) -> None:
        super().__init__(head_dim, num_heads, dropout)
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.bias = bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}, bias={self.bias}"

    def weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        allowed = attention_mask(
            q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
            device=q.device,
        )  # fmt: skip
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores + self.score_bias(q.shape[2], k.shape[2], scores)
        if self.bias is None:
            b = -torch.log(
                visible_keys(allowed, q.shape[2], k.shape[2], q.device).clamp(min=1).to(q.dtype)
            )
        else:
            b = self.bias
        w = torch.sigmoid(scores + b)
        return w if allowed is None else w.masked_fill(~allowed, 0.0)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``1 / (1 + exp(-(s q·k + b)))`` over the allowed pairs, in float64."""
        allowed = naive.pair_mask(q, k, causal, key_padding_mask)
        n = allowed.sum(-1, keepdim=True).double()
        b = -torch.log(torch.where(n > 0, n, 1.0)) if self.bias is None else self.bias
        scores = self.scale * naive.dot(q, k) + self.reference_bias(q.shape[2], k.shape[2])
        w = 1.0 / (1.0 + torch.exp(-(scores + b)))
        return torch.where(allowed, w, torch.zeros_like(w))
