"""The causal linear path: inside each chunk of C tokens the exact polynomial of the
C x C scores, across chunks a running prefix state (never an N x D^p x Dv tensor)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.feature_map.features import (
    blocks_t,
    chunk_major,
    chunk_view,
    constant,
    feature_dim,
    feature_weights,
    features_d,
    features_d_vjp,
    first_order_only,
    weighted_state,
)
from transformers_lab.attention.feature_map.steps import steps


def group_size(c: int, f: int, batch_heads: int) -> int:
    """G, the chunks one step takes at once: the largest power of two up to ``MAX_GROUP``
    whose feature blocks (G x B x H x F x C numbers for each of q and k) stay within
    ``GROUP_NUMBERS``, at least 1. Small feature maps (elu + 1, p=1) go many chunks a
    step, fastmax p=2 one: fewer, larger operations and Python steps for the same
    arithmetic, on blocks that stay in cache (causal forward and backward at N=16384,
    C=128, 2 threads: elu + 1 1.47x, p=1 1.29x, cosFormer 1.29x faster than a chunk a
    step; fastmax p=2, whose blocks fill the budget alone, unchanged)."""
    fit = max(1, min(MAX_GROUP, GROUP_NUMBERS // (c * f * batch_heads)))
    return 1 << (fit.bit_length() - 1)


GROUP_NUMBERS = 1 << 18  # numbers of one feature block of a step (1 MiB in fp32)
MAX_GROUP = 32


def groups(nc: int, g: int) -> list[slice]:
    """Chunks 0..nc in steps of ``g`` chunks (a power of two), the rest in halving
    steps: steps of g, g / 2, .., 1 chunks only, whatever nc, so that a compiled step
    compiles at most log2(g) + 1 block shapes."""
    out, i = [], 0
    while i < nc:
        size = g
        while size > nc - i:
            size //= 2
        out.append(slice(i, i + size))
        i += size
    return out


class _ChunkLoop(torch.autograd.Function):
    """The causal chunk recurrence with a hand-written backward pass.

    Inputs are square and whole chunks: q, k (B, H, N, D), v_aug (B, H, N, Dv + 1) with N
    a multiple of C, and the initial state (B, H, Dv + 1, F). A step takes G chunks at
    once (``group_size``): for each, the output is the exact masked polynomial of the
    chunk plus phi(q) read against the state of the keys before it, where the states
    within a group come from a running sum of the chunks' own contributions. Only the
    inputs (as the steps' chunk-major blocks, which the backward pass then need not copy
    again) and the state before each chunk are saved: the features are recomputed in the
    backward pass, a group at a time, so no N x F tensor is ever held. Each group is one
    call of ``forward_step`` / ``backward_step``, compiled by ``torch.compile`` when
    ``compiled`` (``steps``).
    """

    @staticmethod
    def forward(ctx, q, k, v_aug, state, p, c, compiled=False, g=None):  # type: ignore[override]
        b, h, n, _ = q.shape
        e = q.shape[-1] + constant(p)
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)
        # chunk-major blocks (chunk i is [i]): their strides do not depend on N
        qc, kc, vc = (chunk_major(t, c) for t in (q, k, v_aug))  # (nc, B, H, C, .)
        ut_q, ut_k = blocks_t(qc, p), blocks_t(kc, p)  # (nc, B, H, E + E // 2, C)
        out = torch.empty_like(v_aug)  # written in place: only a step's inputs need blocks
        out_c = chunk_view(out, c)
        keep = any(ctx.needs_input_grad[:4])
        before = q.new_empty(n // c, *state.shape) if keep else None
        step = steps(compiled).forward_step
        state = state.contiguous()
        g = g or group_size(c, w.shape[0], b * h)
        for s in groups(n // c, g):
            out_c[s], state, before_s = step(qc[s], kc[s], vc[s], ut_q[s], ut_k[s], state, w, e, p)
            if keep:
                before[s] = before_s
        ctx.p, ctx.c, ctx.g, ctx.compiled = p, c, g, compiled
        if keep:
            ctx.save_for_backward(qc, kc, vc, before)  # blocks: the backward pass reads them
        return out, state

    @staticmethod
    def backward(ctx, d_out, d_state):  # type: ignore[override]
        first_order_only()
        qc, kc, vc, before = ctx.saved_tensors
        p, c, n = ctx.p, ctx.c, d_out.shape[2]
        e = qc.shape[-1] + constant(p)
        w = feature_weights(qc.shape[-1], p, qc.dtype, qc.device)[:, None]  # (F, 1)
        doc = chunk_major(d_out, c)
        ut_q, ut_k = blocks_t(qc, p), blocks_t(kc, p)  # (nc, B, H, E + E // 2, C)
        grads = tuple(x.new_empty(*x.shape[1:3], n, x.shape[-1]) for x in (qc, kc, vc))
        dq, dk, dv = (chunk_view(t, c) for t in grads)
        d_s = d_state.contiguous()  # gradient w.r.t. the state after the group's keys
        step = steps(ctx.compiled).backward_step
        for s in reversed(groups(n // c, ctx.g)):
            dq[s], dk[s], dv[s], d_s = step(
                qc[s], kc[s], vc[s], doc[s], ut_q[s], ut_k[s], before[s], d_s, w, e, p
            )
        return *grads, d_s, None, None, None, None


def forward_step(qi, ki, vi, ut_qi, ut_ki, state, w, e: int, p: int):
    """G chunks of the causal forward pass (blocks (G, B, H, ...)): their outputs (G, B,
    H, C, Dv + 1), the exact masked polynomial of each chunk plus phi(q) read against the
    state of the keys before it; the state (B, H, Dv + 1, F) once all their keys have
    joined; and the state before each chunk (G, B, H, Dv + 1, F)."""
    phi_q = features_d(ut_qi, e, p)  # (G, B, H, F, C)
    phi_k = features_d(ut_ki, e, p)
    scores = masked_poly(qi @ ki.mT, p)  # (G, B, H, C, C)
    added = (vi.mT @ phi_k.mT).mul_(w)  # each chunk's keys' part of the state
    if len(added) == 1:  # (a block shape is static: one branch per compiled step)
        before, after = state.unsqueeze(0), state + added[0]
    else:
        joined = added.cumsum(0).add_(state)  # the state after each chunk
        before, after = torch.cat([state.unsqueeze(0), joined[:-1]]), joined[-1]
    out = torch.matmul(phi_q.mT, before.mT).add_(scores @ vi)
    return out, after, before


def backward_step(qi, ki, vi, doi, ut_qi, ut_ki, before, d_s, w, e: int, p: int):
    """G chunks of the backward pass, last group first: the gradients of their q, k and
    v_aug, and ``d_s`` for the group before (the gradient of the state its keys join, given
    that of the state after this group's). ``before`` is the state each chunk's queries
    read; w is (F, 1)."""
    phi_q = features_d(ut_qi, e, p)  # (G, B, H, F, C)
    phi_k = features_d(ut_ki, e, p)
    if p == 2:  # a new tensor (the weights of p < 2 are ones, phi_k a view of ut_k)
        phi_k = phi_k.mul_(w)
    x = qi @ ki.mT
    scores = masked_poly(x, p)  # a new tensor for p=2, whose x is still needed
    # through the states: out_i = phi_q^T S_i^T, and S_i holds the keys of chunks before i.
    # Chunk i's queries give the state they read do_i^T phi_q^T; the keys of chunk i reach
    # every later chunk's: their state's gradient is d_s plus those of the later chunks
    reads = doi.mT @ phi_q.mT  # (G, B, H, Dv + 1, F)
    if len(reads) == 1:
        after, d_before = d_s.unsqueeze(0), d_s + reads[0]
    else:
        later = reads.flip(0).cumsum(0).flip(0)  # [i]: the reads of chunks i.. of the group
        after = torch.cat([later[1:], torch.zeros_like(later[:1])]).add_(d_s)
        d_before = later[0] + d_s
    dv = torch.matmul(phi_k.mT, after.mT).add_(scores.mT @ doi)
    d_phi_k = (after.mT @ vi.mT).mul_(w)  # (G, B, H, F, C)
    d_phi_q = before.mT @ doi.mT
    # through the chunk's own polynomial, poly'(x) = 1 (p=1) or 1 + x (p=2)
    dx = (doi @ vi.mT).tril_()
    if p == 2:
        dx.mul_(x.add_(1.0))
    d_ut_q = features_d_vjp(ut_qi, e, d_phi_q, p)[..., constant(p) :, :]
    d_ut_k = features_d_vjp(ut_ki, e, d_phi_k, p)[..., constant(p) :, :]
    dq = torch.matmul(dx, ki).add_(d_ut_q.mT)
    dk = torch.matmul(dx.mT, qi).add_(d_ut_k.mT)
    return dq, dk, dv, d_before


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
    group: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal linear path. Returns the output and the state after the last key.

    ``state`` (B, H, Dv + 1, F) is ``weighted_state`` of the keys seen before ``k``.
    Queries are aligned to the last Nq keys, as in the kernel contract. ``compiled``:
    each chunk's step compiled by ``torch.compile`` (see ``steps``). ``group``: the
    chunks a step takes at once (``group_size`` chooses by default).
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
    out, state = _ChunkLoop.apply(q, k, v_aug, state, p, c, compiled, group)
    return out[:, :, :nq], state
