"""The non-causal linear path: one state over every key, read by every query, a chunk
at a time with a hand-written backward pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.fastmax.features import (
    chunks_t,
    constant,
    feature_weights,
    features_d,
    features_d_vjp,
    first_order_only,
)


def factorized(q: Tensor, k: Tensor, v_aug: Tensor, p: int, chunk_size: int = 128) -> Tensor:
    """Non-causal linear path: one state over every key, read by every query.

    Keys and queries are processed up to ``chunk_size`` at a time (see ``_FactorizedLoop``).
    """
    nq, nk = q.shape[2], k.shape[2]
    cq, ck = min(chunk_size, nq), min(chunk_size, nk)
    q = F.pad(q, (0, 0, 0, -nq % cq))
    k, v_aug = (F.pad(t, (0, 0, 0, -nk % ck)) for t in (k, v_aug))  # empty keys
    return _FactorizedLoop.apply(q, k, v_aug, p, cq, ck)[:, :, :nq]  # (B, H, Nq, Dv + 1)


class _FactorizedLoop(torch.autograd.Function):
    """Non-causal state ``S = sum_j v_aug_j (w phi(k_j))^T`` and its read ``phi(q) S^T``,
    a chunk at a time with a hand-written backward pass: the features are recomputed per
    chunk, so no N x F tensor is ever held. Nq and Nk must be multiples of their chunk
    sizes cq and ck."""

    @staticmethod
    def forward(ctx, q, k, v_aug, p, cq, ck):  # type: ignore[override]
        b, h, nq, _ = q.shape
        e = q.shape[-1] + constant(p)
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)
        ut_q, ut_k = chunks_t(q, cq, p), chunks_t(k, ck, p)  # (B, H, n / C, E + E // 2, C)
        state = q.new_zeros(b, h, v_aug.shape[-1], w.shape[0])  # (B, H, Dv + 1, F)
        for i in range(k.shape[2] // ck):
            vi = v_aug[:, :, i * ck : (i + 1) * ck]
            state += (vi.mT @ features_d(ut_k[:, :, i], e, p).mT).mul_(w)
        out = q.new_empty(b, h, nq, v_aug.shape[-1])
        for i in range(nq // cq):
            out[:, :, i * cq : (i + 1) * cq] = features_d(ut_q[:, :, i], e, p).mT @ state.mT
        ctx.p, ctx.cq, ctx.ck = p, cq, ck
        ctx.save_for_backward(q, k, v_aug, state)
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        first_order_only()
        q, k, v_aug, state = ctx.saved_tensors
        p, cq, ck = ctx.p, ctx.cq, ctx.ck
        e = q.shape[-1] + constant(p)
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)[:, None]  # (F, 1)
        ut_q, ut_k = chunks_t(q, cq, p), chunks_t(k, ck, p)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v_aug)
        d_s = torch.zeros_like(state)
        for i in range(q.shape[2] // cq):
            rows = slice(i * cq, (i + 1) * cq)
            doi = d_out[:, :, rows]
            d_ut_q = features_d_vjp(ut_q[:, :, i], e, state.mT @ doi.mT, p)[..., constant(p) :, :]
            dq[:, :, rows] = d_ut_q.mT
            d_s += doi.mT @ features_d(ut_q[:, :, i], e, p).mT
        for i in range(k.shape[2] // ck):
            rows = slice(i * ck, (i + 1) * ck)
            vi = v_aug[:, :, rows]
            dv[:, :, rows] = features_d(ut_k[:, :, i], e, p).mul(w).mT @ d_s.mT
            d_ut_k = features_d_vjp(ut_k[:, :, i], e, (d_s.mT @ vi.mT).mul_(w), p)[
                ..., constant(p) :, :
            ]
            dk[:, :, rows] = d_ut_k.mT
        return dq, dk, dv, None, None, None
