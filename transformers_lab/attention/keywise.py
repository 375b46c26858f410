"""Keywise attention: the kernels that weigh each key on its own, from its score alone
and the number of keys the query may see, with no normalisation over the keys (sigmoid
and ReLU attention). The masks, the scale and ALiBi are shared here; a kernel gives its
activation, on tensors and in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.masks import attention_mask, visible_keys


class KeywiseAttention(AttentionKernel, register=False):
    """A kernel that weighs each key on its own, ``f(s q·k + bias, n)`` with n the number
    of keys the query may see, and does not normalise over the keys (sigmoid and ReLU
    attention). Counting only the visible keys keeps a causal query's weights the same in
    a full forward and in decoding. A subclass gives ``activate`` (on tensors) and
    ``reference_activate`` (in float64); the masks, the scale and ALiBi are shared.

    Args:
        scale: s; None means 1/sqrt(head_dim).
    """

    normalized = False
    forms_scores = True

    def __init__(
        self, head_dim: int, n_head: int, dropout: float = 0.0, scale: float | None = None
    ) -> None:
        super().__init__(head_dim, n_head, dropout)
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}"

    def activate(self, scores: Tensor, n: Tensor) -> Tensor:
        """The weights from the scores (ALiBi's bias added) and the visible keys n."""
        raise NotImplementedError

    def reference_activate(self, scores: Tensor, n: Tensor) -> Tensor:
        """``activate`` written naively, in float64 (n >= 1)."""
        raise NotImplementedError

    def weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        nq, nk = q.shape[2], k.shape[2]
        allowed = attention_mask(
            nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
        )
        n = visible_keys(allowed, nq, nk, q.device).clamp(min=1).to(q.dtype)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        w = self.activate(scores + self.score_bias(nq, nk, scores), n)
        return w if allowed is None else w.masked_fill(~allowed, 0.0)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        allowed = naive.pair_mask(q, k, causal, key_padding_mask)
        n = allowed.sum(-1, keepdim=True).double()
        scores = self.scale * naive.dot(q, k) + self.reference_bias(q.shape[2], k.shape[2])
        w = self.reference_activate(scores, torch.where(n > 0, n, 1.0))
        return torch.where(allowed, w, torch.zeros_like(w))
