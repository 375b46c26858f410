"""The causal linear path: inside each chunk of C tokens the exact polynomial of the
C x C scores, across chunks a running prefix state (never an N x D^p x Dv tensor)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.fastmax.features import (
    chunk_major,
    chunks_t,
    constant,
    feature_dim,
    feature_weights,
    features_d,
    features_d_vjp,
    first_order_only,
    weighted_state,
)
from transformers_lab.attention.fastmax.steps import steps


class _ChunkLoop(torch.autograd.Function):
    """The causal chunk recurrence with a hand-written backward pass.

    Inputs are square and whole chunks: q, k (B, H, N, D), v_aug (B, H, N, Dv + 1) with N
    a multiple of C, and the initial state (B, H, Dv + 1, F). Chunk by chunk, the output
    is the exact masked polynomial of the chunk plus phi(q) read against the state, and
    then the chunk's keys join the state. Only the inputs and the state before each chunk
    are saved: the features are recomputed in the backward pass, one chunk at a time, so
    no N x F tensor is ever held and every step works on cache-sized blocks. Each chunk is
    one call of ``forward_step`` / ``backward_step``, compiled by ``torch.compile`` when
    ``compiled`` (``steps``).
    """

    @staticmethod
    def forward(ctx, q, k, v_aug, state, p, c, compiled=False):  # type: ignore[override]
        n = q.shape[2]
        e = q.shape[-1] + constant(p)
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)
        # chunk-major blocks (chunk i is [i]): their strides do not depend on N
        qc, kc, vc = (chunk_major(t, c) for t in (q, k, v_aug))  # (nc, B, H, C, .)
        ut_q, ut_k = chunks_t(q, c, p), chunks_t(k, c, p)  # (nc, B, H, E + E // 2, C)
        out = torch.empty_like(v_aug)  # written in place: only a step's inputs need blocks
        keep = any(ctx.needs_input_grad[:4])
        before = q.new_empty(n // c, *state.shape) if keep else None
        step = steps(compiled).forward_step
        state = state.contiguous()
        for i in range(n // c):
            if keep:
                before[i] = state
            rows = slice(i * c, (i + 1) * c)
            out[:, :, rows], state = step(qc[i], kc[i], vc[i], ut_q[i], ut_k[i], state, w, e, p)
        ctx.p, ctx.c, ctx.compiled = p, c, compiled
        if keep:
            ctx.save_for_backward(q, k, v_aug, before)
        return out, state

    @staticmethod
    def backward(ctx, d_out, d_state):  # type: ignore[override]
        first_order_only()
        q, k, v_aug, before = ctx.saved_tensors
        p, c = ctx.p, ctx.c
        e = q.shape[-1] + constant(p)
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)[:, None]  # (F, 1)
        qc, kc, vc, doc = (chunk_major(t, c) for t in (q, k, v_aug, d_out))
        ut_q, ut_k = chunks_t(q, c, p), chunks_t(k, c, p)  # (nc, B, H, E + E // 2, C)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v_aug)
        d_s = d_state.contiguous()  # gradient w.r.t. the state that chunk i's keys join
        step = steps(ctx.compiled).backward_step
        for i in reversed(range(q.shape[2] // c)):
            rows = slice(i * c, (i + 1) * c)
            dq[:, :, rows], dk[:, :, rows], dv[:, :, rows], d_s = step(
                qc[i], kc[i], vc[i], doc[i], ut_q[i], ut_k[i], before[i], d_s, w, e, p
            )
        return dq, dk, dv, d_s, None, None, None


def forward_step(qi, ki, vi, ut_qi, ut_ki, state, w, e: int, p: int) -> tuple[Tensor, Tensor]:
    """One chunk of the causal forward pass: its output (B, H, C, Dv + 1), the exact
    masked polynomial of the chunk plus phi(q) read against the state of the keys before
    it, and the state (B, H, Dv + 1, F) once its keys have joined."""
    phi_q = features_d(ut_qi, e, p)  # (B, H, F, C)
    phi_k = features_d(ut_ki, e, p)
    scores = masked_poly(qi @ ki.mT, p)  # (B, H, C, C)
    out = torch.matmul(phi_q.mT, state.mT).add_(scores @ vi)
    return out, state + (vi.mT @ phi_k.mT).mul_(w)


def backward_step(qi, ki, vi, doi, ut_qi, ut_ki, before, d_s, w, e: int, p: int):
    """One chunk of the backward pass, last chunk first: the gradients of the chunk's
    q, k and v_aug, and ``d_s`` (the gradient of the state its keys join) for the chunk
    before it. ``before`` is the state the chunk's queries read; w is (F, 1)."""
    phi_q = features_d(ut_qi, e, p)  # (B, H, F, C)
    phi_k = features_d(ut_ki, e, p)
    if p == 2:  # a new tensor (the weights of p < 2 are ones, phi_k a view of ut_k)
        phi_k = phi_k.mul_(w)
    x = qi @ ki.mT
    scores = masked_poly(x, p)  # a new tensor for p=2, whose x is still needed
    # through the state: out_i = phi_q^T S^T, and later states gain v_i (w phi_k)^T
    dv = torch.matmul(phi_k.mT, d_s.mT).add_(scores.mT @ doi)
    d_phi_k = (d_s.mT @ vi.mT).mul_(w)  # (B, H, F, C)
    d_phi_q = before.mT @ doi.mT
    d_s = d_s + doi.mT @ phi_q.mT
    # through the chunk's own polynomial, poly'(x) = 1 (p=1) or 1 + x (p=2)
    dx = (doi @ vi.mT).tril_()
    if p == 2:
        dx.mul_(x.add_(1.0))
    d_ut_q = features_d_vjp(ut_qi, e, d_phi_q, p)[..., constant(p) :, :]
    d_ut_k = features_d_vjp(ut_ki, e, d_phi_k, p)[..., constant(p) :, :]
    dq = torch.matmul(dx, ki).add_(d_ut_q.mT)
    dk = torch.matmul(dx.mT, qi).add_(d_ut_k.mT)
    return dq, dk, dv, d_s


def masked_poly(x: Tensor, p: int) -> Tensor:
    """poly(x, p) with the future (above the diagonal) zeroed, in place of x."""
    if p == 2:  # 1 + x + x^2 / 2 as (x / 2 + 1) x + 1
        x = torch.addcmul(x, x, x, value=0.5)
    if p >= 1:
        x.add_(1.0)
    return x.tril_()


def chunked_causal(
    q: Tensor,
    k: Tensor,
    v_aug: Tensor,
    p: int,
    chunk_size: int,
    state: Tensor | None = None,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """Causal linear path. Returns the output and the state after the last key.

    ``state`` (B, H, Dv + 1, F) is ``weighted_state`` of the keys seen before ``k``.
    Queries are aligned to the last Nq keys, as in the kernel contract. ``compiled``:
    each chunk's step compiled by ``torch.compile`` (see ``steps``).
    """
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    if state is None:
        state = q.new_zeros(b, h, v_aug.shape[-1], feature_dim(q.shape[-1], p))
    if nk > nq:  # keys before the first query are visible to every query
        split = nk - nq
        state = state + weighted_state(v_aug[:, :, :split], k[:, :, :split], p)
        k, v_aug = k[:, :, split:], v_aug[:, :, split:]
    elif nq > nk:  # queries before the first key see nothing: prepend empty keys
        k = F.pad(k, (0, 0, nq - nk, 0))
        v_aug = F.pad(v_aug, (0, 0, nq - nk, 0))
    c = min(chunk_size, nq)
    pad = -nq % c  # empty trailing keys and discarded trailing queries
    if pad:
        q, k, v_aug = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v_aug))
    out, state = _ChunkLoop.apply(q, k, v_aug, state, p, c, compiled)
    return out[:, :, :nq], state
