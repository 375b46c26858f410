"""Additive attention (Bahdanau et al., 2015): ``softmax(w·tanh(W_q q + W_k k + b)) v``.

The score of every (query, key) pair passes through a tanh of width ``attn_dim``, so a
naive implementation holds a ``(B, H, Nq, Nk, attn_dim)`` tensor. This kernel scores the
queries in chunks sized to a memory budget and recomputes each chunk's activations in its own
backward pass (``_ChunkScores``, the effect of activation checkpointing without its
overhead), so the extra memory stays bounded whatever Nq.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from transformers_lab.attention import naive
from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.masks import attention_mask, masked_softmax

# The transient memory of one chunk, in (B, H, C, Nk, attn_dim) tensors: the forward holds
# one (the pre-activation, squashed in place), the backward one (recomputed, turned into
# the gradient in place); a second one covers the reductions' temporaries.
_LIVE_COPIES = 2


class _ChunkScores(torch.autograd.Function):
    """Scores of a chunk of queries, ``s = w · tanh(qa + ka)`` over A:
    (B, H, C, A), (B, H, Nk, A), (H, A) -> (B, H, C, Nk).

    Computed as ``tanh(u) = 2 sigmoid(2u) - 1``, so ``s = 2 (w · sigmoid(2u)) - sum(w)``:
    on CPU, torch's tanh costs about three times its sigmoid (8.1 vs 2.7 ms for the 2M
    elements of the MQAR shape, B 32, H 2, N 32, A 32), and these elementwise passes are
    most of the kernel's time. Only the inputs are saved; the backward recomputes the
    (B, H, C, Nk, A) sigmoid and works in place on it, so a chunk's memory stays one such
    tensor (``d tanh(u)/du = 4 sigmoid(2u) (1 - sigmoid(2u))``).
    """

    @staticmethod
    def _sigmoid(qa: Tensor, ka: Tensor) -> Tensor:
        """sigmoid(2 (qa + ka)), (B, H, C, Nk, A), from contiguous inputs into a contiguous
        tensor: the einsum's outputs are strided, and a broadcast sum over them (5.9 vs
        0.6 ms at the MQAR shape) or a result with their strides (every later pass and
        reshape) is several times slower."""
        (b, h, c, a), n = qa.shape, ka.shape[2]
        u = torch.empty(b, h, c, n, a, dtype=qa.dtype, device=qa.device)
        torch.add(qa.contiguous().unsqueeze(3), ka.contiguous().unsqueeze(2), out=u)
        return u.mul_(2.0).sigmoid_()

    @staticmethod
    def forward(ctx: FunctionCtx, qa: Tensor, ka: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(qa, ka, w)
        sig = _ChunkScores._sigmoid(qa, ka)
        return 2.0 * (sig.mul_(w[:, None, None, :])).sum(-1) - w.sum(-1)[:, None, None]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, ds: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qa, ka, w = ctx.saved_tensors
        sig = _ChunkScores._sigmoid(qa, ka)
        b, h, c, n, a = sig.shape
        # dw[h, a] = sum over b, c, n of ds * tanh = 2 sum(ds * sig) - sum(ds)
        dw = (ds.reshape(b, h, 1, c * n) @ sig.reshape(b, h, c * n, a)).sum(0).reshape(h, a)
        dw = 2.0 * dw - ds.sum((0, 2, 3))[:, None]
        # d pre-activation = ds * w * 4 sig (1 - sig), in place on sig
        grad = sig.addcmul_(sig, sig, value=-1.0).mul_(ds.unsqueeze(-1))
        grad = grad.mul_(4.0 * w[:, None, None, :])
        return grad.sum(3), grad.sum(2), dw.to(w.dtype)


class AdditiveAttention(AttentionKernel):
    """Bahdanau attention with per-head parameters sized by the head dimension.

    Args:
        attn_dim: width A of the tanh layer; ``None`` means ``head_dim``.
        bias: learn the bias ``b`` inside the tanh.
        memory_budget_mb: cap on the transient memory of one query chunk (forward and
            backward), which sets how many queries are scored at once.
    """

    name = "additive"
    forms_scores = True
    formula = "softmax(wᵀ tanh(W_q q + W_k k + b))"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        attn_dim: int | None = None,
        bias: bool = True,
        memory_budget_mb: float = 64.0,
    ) -> None:
        super().__init__(head_dim, n_head, dropout)
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
            torch.empty(n_head, head_dim, attn_dim).uniform_(-bound_in, bound_in)
        )
        self.w_k = nn.Parameter(
            torch.empty(n_head, head_dim, attn_dim).uniform_(-bound_in, bound_in)
        )
        self.b = nn.Parameter(torch.zeros(n_head, attn_dim)) if bias else None
        self.w = nn.Parameter(torch.empty(n_head, attn_dim).uniform_(-bound_out, bound_out))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, attn_dim={self.attn_dim}, "
            f"memory_budget_mb={self.memory_budget_mb}"
        )

    def chunk_rows(self, batch: int, nk: int, dtype: torch.dtype) -> int:
        """How many queries one chunk holds under the memory budget (at least one)."""
        per_row = _LIVE_COPIES * batch * self.n_head * nk * self.attn_dim
        per_row *= torch.finfo(dtype).bits // 8
        return max(1, int(self.memory_budget_mb * 2**20) // per_row)

    def scores(self, q: Tensor, k: Tensor) -> Tensor:
        """Unnormalised scores ``w·tanh(W_q q + W_k k + b)``, shape (B, H, Nq, Nk), in
        float32 at least: under autocast the sums over A stay out of bf16 / fp16."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            return self._scores(q.to(dtype), k.to(dtype))

    def _scores(self, q: Tensor, k: Tensor) -> Tensor:
        qa = torch.einsum("bhnd,hda->bhna", q, self.w_q.to(q.dtype))  # (B, H, Nq, A)
        if self.b is not None:
            qa = qa + self.b[:, None, :]
        ka = torch.einsum("bhnd,hda->bhna", k, self.w_k.to(k.dtype))  # (B, H, Nk, A)
        rows = self.chunk_rows(q.shape[0], k.shape[2], q.dtype)
        w = self.w.to(qa.dtype)
        chunks = [
            _ChunkScores.apply(qa[:, :, start : start + rows], ka, w)
            for start in range(0, q.shape[2], rows)
        ]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """softmax_j of ``w_h · tanh(W_q,h q_i + W_k,h k_j + b_h)``, one pair at a time
        over a (B, H, Nq, Nk, A) tensor, in float64."""
        q, k = q.double(), k.double()
        pre = torch.einsum("bhid,hda->bhia", q, self.w_q.double())[:, :, :, None, :]
        pre = pre + torch.einsum("bhjd,hda->bhja", k, self.w_k.double())[:, :, None, :, :]
        if self.b is not None:
            pre = pre + self.b.double()[None, :, None, None, :]
        scores = torch.einsum("bhija,ha->bhij", torch.tanh(pre), self.w.double())
        scores = scores + self.reference_bias(q.shape[2], k.shape[2])
        return naive.softmax_rows(scores, naive.pair_mask(q, k, causal, key_padding_mask))

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
        scores = self.scores(q, k)
        return masked_softmax(scores + self.score_bias(q.shape[2], k.shape[2], scores), allowed)
