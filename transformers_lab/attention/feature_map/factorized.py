"""The non-causal linear path: one state over every key, read by every query, a chunk
at a time with a hand-written backward pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.feature_map.features import (
    chunk_major,
    chunk_view,
    chunks_t,
    constant,
    feature_weights,
    features_d,
    features_d_vjp,
    first_order_only,
)
from transformers_lab.attention.feature_map.steps import steps


def factorized(
    q: Tensor, k: Tensor, v_aug: Tensor, p: int, chunk_size: int = 128, compiled: bool = False
) -> Tensor:
    """Non-causal linear path: one state over every key, read by every query.

    Keys and queries are processed up to ``chunk_size`` at a time (see ``_FactorizedLoop``);
    ``compiled``: each chunk's step compiled by ``torch.compile`` (see ``steps``).
    """
    nq, nk = q.shape[2], k.shape[2]
    cq, ck = min(chunk_size, nq), min(chunk_size, nk)
    q = F.pad(q, (0, 0, 0, -nq % cq))
    k, v_aug = (F.pad(t, (0, 0, 0, -nk % ck)) for t in (k, v_aug))  # empty keys
    return _FactorizedLoop.apply(q, k, v_aug, p, cq, ck, compiled)[:, :, :nq]


class _FactorizedLoop(torch.autograd.Function):
    """Non-causal state ``S = sum_j v_aug_j (w phi(k_j))^T`` and its read ``phi(q) S^T``,
    a chunk at a time with a hand-written backward pass: the features are recomputed per
    chunk, so no N x F tensor is ever held. Nq and Nk must be multiples of their chunk
    sizes cq and ck."""

    @staticmethod
    def forward(ctx, q, k, v_aug, p, cq, ck, compiled=False):  # type: ignore[override]
        b, h, _, _ = q.shape
        e = q.shape[-1] + constant(p)
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)
        # chunk-major blocks (chunk i is [i]): their strides do not depend on N
        ut_q, ut_k = chunks_t(q, cq, p), chunks_t(k, ck, p)  # (n / C, B, H, E + E // 2, C)
        vc = chunk_major(v_aug, ck)
        step = steps(compiled)
        state = q.new_zeros(b, h, v_aug.shape[-1], w.shape[0])  # (B, H, Dv + 1, F)
        for i in range(len(ut_k)):
            state = step.state_step(vc[i], ut_k[i], state, w, e, p)
        out = q.new_empty(b, h, q.shape[2], v_aug.shape[-1])  # only inputs need blocks
        out_c = chunk_view(out, cq)
        for i in range(len(ut_q)):
            out_c[i] = step.read_step(ut_q[i], state, e, p)
        ctx.p, ctx.cq, ctx.ck, ctx.compiled = p, cq, ck, compiled
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
        vc, doc = chunk_major(v_aug, ck), chunk_major(d_out, cq)
        step = steps(ctx.compiled)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v_aug)
        dq_c, dk_c, dv_c = chunk_view(dq, cq), chunk_view(dk, ck), chunk_view(dv, ck)
        d_s = torch.zeros_like(state)
        for i in range(len(ut_q)):
            dq_c[i], d_s = step.query_grad_step(ut_q[i], doc[i], state, d_s, e, p)
        for i in range(len(ut_k)):
            dk_c[i], dv_c[i] = step.key_grad_step(ut_k[i], vc[i], d_s, w, e, p)
        return dq, dk, dv, None, None, None, None


def state_step(vi: Tensor, ut_ki: Tensor, state: Tensor, w: Tensor, e: int, p: int) -> Tensor:
    """The state once a chunk of keys (doubled layout ``ut_ki``) and values has joined it."""
    return state + (vi.mT @ features_d(ut_ki, e, p).mT).mul_(w)


def read_step(ut_qi: Tensor, state: Tensor, e: int, p: int) -> Tensor:
    """A chunk of queries read against the state: (B, H, C, Dv + 1)."""
    return features_d(ut_qi, e, p).mT @ state.mT


def query_grad_step(ut_qi: Tensor, doi: Tensor, state: Tensor, d_s: Tensor, e: int, p: int):
    """The gradient of a chunk of queries, and ``d_s`` (the state's) with its part added."""
    d_ut_q = features_d_vjp(ut_qi, e, state.mT @ doi.mT, p)[..., constant(p) :, :]
    return d_ut_q.mT, d_s + doi.mT @ features_d(ut_qi, e, p).mT


def key_grad_step(ut_ki: Tensor, vi: Tensor, d_s: Tensor, w: Tensor, e: int, p: int):
    """The gradients of a chunk of keys and of its values, from the state's ``d_s``."""
    dv = features_d(ut_ki, e, p).mul(w).mT @ d_s.mT
    d_ut_k = features_d_vjp(ut_ki, e, (d_s.mT @ vi.mT).mul_(w), p)[..., constant(p) :, :]
    return d_ut_k.mT, dv
