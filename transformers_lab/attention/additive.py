"""Additive attention (Bahdanau et al., 2015): ``softmax(w·tanh(W_q q + W_k k + b)) v``.

The score of every (query, key) pair passes through a tanh of width ``attn_dim``, so a
naive implementation holds a ``(B, H, Nq, Nk, attn_dim)`` tensor. This kernel scores the
queries in chunks sized to a memory budget and recomputes each chunk in the backward
pass (activation checkpointing), so the extra memory stays bounded whatever Nq.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from transformers_lab.attention.base import AttentionKernel, attention_mask, masked_softmax

# The transient tensors of one chunk, counted in (B, H, C, Nk, attn_dim) units: the
# pre-activation and its tanh in the forward, the tanh and two gradients in the backward.
_LIVE_COPIES = 4


def _chunk_scores(qa: Tensor, ka: Tensor, w: Tensor) -> Tensor:
    """Scores of a chunk of queries: (B, H, C, A), (B, H, Nk, A), (H, A) -> (B, H, C, Nk)."""
    t = torch.tanh(qa.unsqueeze(3) + ka.unsqueeze(2))  # (B, H, C, Nk, A)
    return (t @ w[:, None, :, None]).squeeze(-1)  # (B, H, C, Nk)


class AdditiveAttention(AttentionKernel):
    """Bahdanau attention with per-head parameters sized by the head dimension.

    Args:
        attn_dim: width A of the tanh layer; ``None`` means ``head_dim``.
        bias: learn the bias ``b`` inside the tanh.
        memory_budget_mb: cap on the transient memory of one query chunk (forward and
            backward), which sets how many queries are scored at once.
    """

    name = "additive"

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        attn_dim: int | None = None,
        bias: bool = True,
        memory_budget_mb: float = 64.0,
    ) -> None:
        super().__init__(head_dim, num_heads, dropout)
        attn_dim = head_dim if attn_dim is None else attn_dim
        if attn_dim <= 0:
            raise ValueError(f"additive: attn_dim must be positive, got {attn_dim}")
        if memory_budget_mb <= 0:
            raise ValueError(f"additive: memory_budget_mb must be positive, got {memory_budget_mb}")
        self.attn_dim = attn_dim
        self.memory_budget_mb = memory_budget_mb
        # Same init as nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound_in, bound_out = 1.0 / math.sqrt(head_dim), 1.0 / math.sqrt(attn_dim)
        self.w_q = nn.Parameter(
            torch.empty(num_heads, head_dim, attn_dim).uniform_(-bound_in, bound_in)
        )
        self.w_k = nn.Parameter(
            torch.empty(num_heads, head_dim, attn_dim).uniform_(-bound_in, bound_in)
        )
        self.b = nn.Parameter(torch.zeros(num_heads, attn_dim)) if bias else None
        self.w = nn.Parameter(torch.empty(num_heads, attn_dim).uniform_(-bound_out, bound_out))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, attn_dim={self.attn_dim}, "
            f"memory_budget_mb={self.memory_budget_mb}"
        )

    def chunk_rows(self, batch: int, nk: int, dtype: torch.dtype) -> int:
        """How many queries one chunk holds under the memory budget (at least one)."""
        per_row = _LIVE_COPIES * batch * self.num_heads * nk * self.attn_dim
        per_row *= torch.finfo(dtype).bits // 8
        return max(1, int(self.memory_budget_mb * 2**20) // per_row)

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        """Unnormalised scores ``w·tanh(W_q q + W_k k + b)``, shape (B, H, Nq, Nk)."""
        qa = torch.einsum("bhnd,hda->bhna", q, self.w_q)  # (B, H, Nq, A)
        if self.b is not None:
            qa = qa + self.b[:, None, :]
        ka = torch.einsum("bhnd,hda->bhna", k, self.w_k)  # (B, H, Nk, A)
        rows = self.chunk_rows(q.shape[0], k.shape[2], q.dtype)
        recompute = torch.is_grad_enabled() and (q.requires_grad or self.w.requires_grad)
        chunks = []
        for start in range(0, q.shape[2], rows):
            qa_c = qa[:, :, start : start + rows]
            if recompute:
                chunks.append(checkpoint(_chunk_scores, qa_c, ka, self.w, use_reentrant=False))
            else:
                chunks.append(_chunk_scores(qa_c, ka, self.w))
        return torch.cat(chunks, dim=2)

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        allowed = attention_mask(
            q.shape[2],
            k.shape[2],
            causal=causal,
            key_padding_mask=key_padding_mask,
            device=q.device,
        )
        return masked_softmax(self.scores(q, k), allowed)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, v, key_padding_mask)
        attn = self.weights(q, k, causal=causal, key_padding_mask=key_padding_mask)
        attn = nn.functional.dropout(attn, self.dropout, self.training)
        return attn @ v  # (B, H, Nq, Dv)
