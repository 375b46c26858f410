"""Fastmax of order 2 in linear time, fused: the Triton kernels of ``attention.backend=triton``
(``triton_ops`` calls them; this file is imported only there, once Triton is asked for).

For causal attention with weights f(x_ij) = c0 + c1 x + c2 x^2, x = q_i . k_j (fastmax
p=2: 1, 1, 1/2, queries and keys already normalised and scaled), the output is
``sum_j f(x_ij) v_j / sum_j f(x_ij)`` over j <= i. Over the keys of earlier chunks it
factorises through three states, built chunk by chunk:

- S0 = sum_j v_j, S1 = sum_j k_j (x) v_j and S2 = sum_j (k_j (x) k_j) (x) v_j, so that
  sum_j f(x_ij) v_j = c0 S0 + c1 q . S1 + c2 q^T S2 q;
- Z0, Z1, Z2, the same with the key's weight m_j (1, or 0 where it is padding) for v_j:
  the normaliser, in the same pass, with coefficients d0, d1, d2 (the same as c).

Within a chunk the kernel computes the C x C weights themselves. S2 is D x D x Dv: far
more than fits on chip, so it is cut in tiles, and only its symmetric half is kept: the
rows and columns of S2 fall in blocks of BA, and a program owns one pair of blocks A <= B
(its features q_a q_b, a in A, b in B, are BA x BA wide; a pair off the diagonal counts
twice, for the (B, A) block it stands for) and BV of the value columns. It keeps its tile
in registers while it walks the chunks in order, and adds its part of each output with an
atomic add; the program of the pair (0, 0) also keeps S0, S1, Z0, Z1 and does the chunk's
own C x C block. No feature tensor (1 + D + D^2 a token) is ever written to memory, and
memory grows with N only through the inputs and outputs.

The backward pass is two more kernels of the same tiling: ``_dq``, forward over the
chunks with the states of the keys, and ``_dkdv``, backward over them with the states of
the queries (sums of q (x) g, (q (x) q) (x) g and of the normaliser's h). g = dy / z and h
= -(dy . y) / z come from the caller.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _features(b_a, b_b, C: tl.constexpr, BA: tl.constexpr):
    """The second-order features of a tile: x_a x_b for a in block A, b in block B,
    (C, BA) and (C, BA) -> (C, BA * BA)."""
    return tl.reshape(b_a[:, :, None] * b_b[:, None, :], (C, BA * BA))


@triton.jit
def _load(base, rows, cols, width, live):
    """The tile of rows ``rows`` (zeros where not ``live``) and columns ``cols`` of a
    row-major matrix ``width`` wide."""
    return tl.load(base + rows[:, None] * width + cols[None, :], mask=live[:, None], other=0.0)


@triton.jit
def _pair_columns(base, rows, o_a, o_b, D: tl.constexpr, live):
    """The tiles of a pair's two blocks of columns of q or k: (C, BA) each."""
    return _load(base, rows, o_a, D, live), _load(base, rows, o_b, D, live)


@triton.jit
def _key_weights(MASK, rows, live, HAS_MASK: tl.constexpr):
    """The keys' weights m_j of these rows: 1, or 0 where a key is padding (``MASK``, this
    head's row) or past the end."""
    if HAS_MASK:
        return tl.load(MASK + rows, mask=live, other=0.0).to(tl.float32)
    return live.to(tl.float32)


@triton.jit
def _pair(PAIRS, D: tl.constexpr, BA: tl.constexpr):
    """This program's blocks A <= B (``PAIRS``: int32 (pairs, 2)): their indices, the rows
    of S2 their tile holds (a * D + b), and whether they are two blocks (off the
    diagonal)."""
    i_p = tl.program_id(1)
    blk_a, blk_b = tl.load(PAIRS + 2 * i_p), tl.load(PAIRS + 2 * i_p + 1)
    o_a = blk_a * BA + tl.arange(0, BA)
    o_b = blk_b * BA + tl.arange(0, BA)
    o_r = tl.reshape(o_a[:, None] * D + o_b[None, :], (BA * BA,))
    return o_a, o_b, o_r, blk_a != blk_b


@triton.jit
def _fold(t2, b_a, b_b, C: tl.constexpr, BA: tl.constexpr):
    """The gradient through x_a x_b of a pair's tile: t2 (C, BA * BA) [i, (a, b)] to
    (sum_a b_a[i, a] t2[i, a, b]) for block B and (sum_b b_b[i, b] t2[i, a, b]) for A."""
    t3 = tl.reshape(t2, (C, BA, BA))
    return tl.sum(t3 * b_a[:, :, None], 1), tl.sum(t3 * b_b[:, None, :], 2)


@triton.jit
def _fwd(
    Q, K, V, MASK, O, Z, PAIRS,
    S0, S1, S2, Z0, Z1, Z2,
    N, c0, c1, c2, d0, d1, d2,
    D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BA: tl.constexpr, BV: tl.constexpr,
    HAS_MASK: tl.constexpr, STATE_IN: tl.constexpr, STATE_OUT: tl.constexpr,
):  # fmt: skip
    i_v, i_bh = tl.program_id(0), tl.program_id(2)
    o_a, o_b, o_r, off = _pair(PAIRS, D, BA)
    o_c, o_d = tl.arange(0, C), tl.arange(0, D)
    o_v = i_v * BV + tl.arange(0, BV)
    q_base, k_base = Q + i_bh * N * D, K + i_bh * N * D
    v_base, o_base = V + i_bh * N * DV, O + i_bh * N * DV
    first = tl.program_id(1) == 0  # the pair (0, 0): also S0, S1, Z0, Z1 and the chunk's block
    zrow = i_v == 0  # the programs that write the normaliser
    twice = tl.where(off, 2.0, 1.0)  # a pair off the diagonal stands for (B, A) too
    b_s2 = tl.zeros([BA * BA, BV], dtype=tl.float32)
    b_z2 = tl.zeros([BA * BA], dtype=tl.float32)
    b_s1 = tl.zeros([D, BV], dtype=tl.float32)
    b_s0 = tl.zeros([BV], dtype=tl.float32)
    b_z1 = tl.zeros([D], dtype=tl.float32)
    b_z0 = tl.zeros([1], dtype=tl.float32)
    if STATE_IN:  # the state in is the state out's buffer: a program may read a part that
        # another has already written over, but uses only the parts that it writes itself
        b_s2 = tl.load(S2 + i_bh * D * D * DV + o_r[:, None] * DV + o_v[None, :])
        b_z2 = tl.load(Z2 + i_bh * D * D + o_r)
        b_s1 = tl.load(S1 + i_bh * D * DV + o_d[:, None] * DV + o_v[None, :])
        b_s0 = tl.load(S0 + i_bh * DV + o_v)
        b_z1 = tl.load(Z1 + i_bh * D + o_d)
        b_z0 = tl.load(Z0 + i_bh + tl.arange(0, 1))
    causal = o_c[:, None] >= o_c[None, :]
    for t in range(0, tl.cdiv(N, C)):
        rows = t * C + o_c
        live = rows < N
        b_qa, b_qb = _pair_columns(q_base, rows, o_a, o_b, D, live)
        b_ka, b_kb = _pair_columns(k_base, rows, o_a, o_b, D, live)
        b_v = _load(v_base, rows, o_v, DV, live)
        phi_q = _features(b_qa, b_qb, C, BA)
        phi_k = _features(b_ka, b_kb, C, BA)
        # the earlier chunks' keys, second order, this program's tile of S2 (its normaliser's
        # part is used by the programs of the first value columns alone, which write it)
        b_o = (c2 * twice) * tl.dot(phi_q, b_s2.to(phi_q.dtype))
        b_z = (d2 * twice) * tl.sum(phi_q.to(tl.float32) * b_z2[None, :], 1)
        b_s2 += tl.dot(tl.trans(phi_k), b_v)
        b_z2 += tl.sum(phi_k.to(tl.float32), 0)  # a padded key is zero
        if first:  # orders 0 and 1, and the chunk's own keys
            b_q = _load(q_base, rows, o_d, D, live)
            b_k = _load(k_base, rows, o_d, D, live)
            b_m = _key_weights(MASK + i_bh * N, rows, live, HAS_MASK)
            b_o += c0 * b_s0[None, :] + c1 * tl.dot(b_q, b_s1.to(b_q.dtype))
            b_z += d0 * b_z0 + d1 * tl.sum(b_q.to(tl.float32) * b_z1[None, :], 1)
            x = tl.dot(b_q, tl.trans(b_k))
            w_o = tl.where(causal, c0 + x * (c1 + c2 * x), 0.0)
            w_z = tl.where(causal, (d0 + x * (d1 + d2 * x)) * b_m[None, :], 0.0)
            b_o += tl.dot(w_o.to(b_v.dtype), b_v)
            b_z += tl.sum(w_z, 1)
            b_s1 += tl.dot(tl.trans(b_k), b_v)
            b_s0 += tl.sum(b_v.to(tl.float32), 0)
            b_z1 += tl.sum(b_k.to(tl.float32), 0)
            b_z0 += tl.sum(b_m, 0)
        tl.atomic_add(o_base + rows[:, None] * DV + o_v[None, :], b_o, mask=live[:, None])
        tl.atomic_add(Z + i_bh * N + rows, b_z, mask=live & zrow)
    if STATE_OUT:  # this pair's block of S2 (``triton_ops`` fills in the (B, A) blocks)
        tl.store(S2 + i_bh * D * D * DV + o_r[:, None] * DV + o_v[None, :], b_s2)
        if zrow:
            tl.store(Z2 + i_bh * D * D + o_r, b_z2)
        if first:
            tl.store(S1 + i_bh * D * DV + o_d[:, None] * DV + o_v[None, :], b_s1)
            tl.store(S0 + i_bh * DV + o_v, b_s0)
            if zrow:
                tl.store(Z1 + i_bh * D + o_d, b_z1)
                tl.store(Z0 + i_bh + tl.arange(0, 1), b_z0)


@triton.jit
def _dq(
    Q, K, V, MASK, G, HN, DQ, PAIRS,
    S1, S2, Z1, Z2,
    N, c1, c2, d1, d2,
    D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BA: tl.constexpr, BV: tl.constexpr,
    HAS_MASK: tl.constexpr, STATE_IN: tl.constexpr,
):  # fmt: skip
    """dq = c1 S1 g + 2 c2 (S2 q) g + h (d1 Z1 + 2 d2 Z2 q) over the earlier chunks' keys
    (S as in ``_fwd``), plus the chunk's own block; this program's part, added."""
    i_v, i_bh = tl.program_id(0), tl.program_id(2)
    o_a, o_b, o_r, off = _pair(PAIRS, D, BA)
    o_c, o_d = tl.arange(0, C), tl.arange(0, D)
    o_v = i_v * BV + tl.arange(0, BV)
    q_base, k_base = Q + i_bh * N * D, K + i_bh * N * D
    v_base, g_base = V + i_bh * N * DV, G + i_bh * N * DV
    dq_base = DQ + i_bh * N * D
    first = tl.program_id(1) == 0
    zrow = (i_v == 0).to(tl.float32)  # the normaliser's part, once over the value blocks
    b_s2 = tl.zeros([BA * BA, BV], dtype=tl.float32)
    b_z2 = tl.zeros([BA * BA], dtype=tl.float32)
    b_s1 = tl.zeros([D, BV], dtype=tl.float32)
    b_z1 = tl.zeros([D], dtype=tl.float32)
    if STATE_IN:
        b_s2 = tl.load(S2 + i_bh * D * D * DV + o_r[:, None] * DV + o_v[None, :])
        b_z2 = tl.load(Z2 + i_bh * D * D + o_r)
        b_s1 = tl.load(S1 + i_bh * D * DV + o_d[:, None] * DV + o_v[None, :])
        b_z1 = tl.load(Z1 + i_bh * D + o_d)
    causal = o_c[:, None] >= o_c[None, :]
    for t in range(0, tl.cdiv(N, C)):
        rows = t * C + o_c
        live = rows < N
        b_qa, b_qb = _pair_columns(q_base, rows, o_a, o_b, D, live)
        b_ka, b_kb = _pair_columns(k_base, rows, o_a, o_b, D, live)
        b_v = _load(v_base, rows, o_v, DV, live)
        b_g = _load(g_base, rows, o_v, DV, live)
        b_h = tl.load(HN + i_bh * N + rows, mask=live, other=0.0) * zrow
        phi_k = _features(b_ka, b_kb, C, BA)
        # d(q^T S2 q)/dq_b = 2 sum_a q_a S2[a, b], and the same for a off the diagonal
        t2 = 2.0 * c2 * tl.dot(b_g, tl.trans(b_s2).to(b_g.dtype))
        t2 += 2.0 * d2 * b_h[:, None] * b_z2[None, :]
        dq_b, dq_a = _fold(t2, b_qa, b_qb, C, BA)
        tl.atomic_add(dq_base + rows[:, None] * D + o_b[None, :], dq_b, mask=live[:, None])
        tl.atomic_add(dq_base + rows[:, None] * D + o_a[None, :], dq_a,
                      mask=live[:, None] & off)  # fmt: skip
        b_s2 += tl.dot(tl.trans(phi_k), b_v)
        b_z2 += tl.sum(phi_k.to(tl.float32), 0)
        if first:
            b_q = _load(q_base, rows, o_d, D, live)
            b_k = _load(k_base, rows, o_d, D, live)
            b_m = _key_weights(MASK + i_bh * N, rows, live, HAS_MASK)
            b_dq = (
                c1 * tl.dot(b_g, tl.trans(b_s1).to(b_g.dtype)) + d1 * b_h[:, None] * b_z1[None, :]
            )
            x = tl.dot(b_q, tl.trans(b_k))
            gv = tl.dot(b_g, tl.trans(b_v))  # g_i . v_j over this program's value columns
            dx = gv * (c1 + 2.0 * c2 * x) + b_h[:, None] * b_m[None, :] * (d1 + 2.0 * d2 * x)
            b_dq += tl.dot(tl.where(causal, dx, 0.0).to(b_k.dtype), b_k)
            b_s1 += tl.dot(tl.trans(b_k), b_v)
            b_z1 += tl.sum(b_k.to(tl.float32), 0)
            tl.atomic_add(dq_base + rows[:, None] * D + o_d[None, :], b_dq, mask=live[:, None])


@triton.jit
def _dkdv(
    Q, K, V, MASK, G, HN, DK, DV_OUT, PAIRS,
    N, c0, c1, c2, d1, d2,
    D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BA: tl.constexpr, BV: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    """dk and dv, the chunks last to first, over the later chunks' queries: P2 = sum_i
    (q_i (x) q_i) (x) g_i, P1, P0 likewise, and their normaliser's sums of h_i; plus the
    chunk's own block. This program's part, added."""
    i_v, i_bh = tl.program_id(0), tl.program_id(2)
    o_a, o_b, o_r, off = _pair(PAIRS, D, BA)
    o_c, o_d = tl.arange(0, C), tl.arange(0, D)
    o_v = i_v * BV + tl.arange(0, BV)
    q_base, k_base = Q + i_bh * N * D, K + i_bh * N * D
    v_base, g_base = V + i_bh * N * DV, G + i_bh * N * DV
    dk_base = DK + i_bh * N * D
    first = tl.program_id(1) == 0
    zrow = (i_v == 0).to(tl.float32)
    twice = tl.where(off, 2.0, 1.0)
    b_p2 = tl.zeros([BA * BA, BV], dtype=tl.float32)
    b_p2h = tl.zeros([BA * BA], dtype=tl.float32)
    b_p1 = tl.zeros([D, BV], dtype=tl.float32)
    b_p1h = tl.zeros([D], dtype=tl.float32)
    b_p0 = tl.zeros([BV], dtype=tl.float32)
    causal = o_c[:, None] >= o_c[None, :]  # [i, j]: query i sees key j
    nt = tl.cdiv(N, C)
    for s in range(0, nt):
        rows = (nt - 1 - s) * C + o_c
        live = rows < N
        b_qa, b_qb = _pair_columns(q_base, rows, o_a, o_b, D, live)
        b_ka, b_kb = _pair_columns(k_base, rows, o_a, o_b, D, live)
        b_v = _load(v_base, rows, o_v, DV, live)
        b_g = _load(g_base, rows, o_v, DV, live)
        b_h = tl.load(HN + i_bh * N + rows, mask=live, other=0.0) * zrow
        b_m = _key_weights(MASK + i_bh * N, rows, live, HAS_MASK)
        phi_q = _features(b_qa, b_qb, C, BA)
        phi_k = _features(b_ka, b_kb, C, BA)
        # dv_j = sum_i f(x_ij) g_i: c2 phi(k_j) . P2 over this program's pair
        b_dv = (c2 * twice) * tl.dot(phi_k, b_p2.to(phi_k.dtype))
        # dk_j, through x_ij: 2 c2 sum_a k_a P2[a, b] v_j + 2 d2 m_j sum_a k_a P2h[a, b]
        t2 = 2.0 * c2 * tl.dot(b_v, tl.trans(b_p2).to(b_v.dtype))
        t2 += 2.0 * d2 * b_m[:, None] * b_p2h[None, :]
        dk_b, dk_a = _fold(t2, b_ka, b_kb, C, BA)
        tl.atomic_add(dk_base + rows[:, None] * D + o_b[None, :], dk_b, mask=live[:, None])
        tl.atomic_add(dk_base + rows[:, None] * D + o_a[None, :], dk_a,
                      mask=live[:, None] & off)  # fmt: skip
        b_p2 += tl.dot(tl.trans(phi_q), b_g)
        b_p2h += tl.sum(phi_q.to(tl.float32) * b_h[:, None], 0)
        if first:
            b_q = _load(q_base, rows, o_d, D, live)
            b_k = _load(k_base, rows, o_d, D, live)
            b_dv += c0 * b_p0[None, :] + c1 * tl.dot(b_k, b_p1.to(b_k.dtype))
            b_dk = (
                c1 * tl.dot(b_v, tl.trans(b_p1).to(b_v.dtype)) + d1 * b_m[:, None] * b_p1h[None, :]
            )
            x = tl.dot(b_q, tl.trans(b_k))  # [i, j]
            w = tl.where(causal, c0 + x * (c1 + c2 * x), 0.0)
            b_dv += tl.dot(tl.trans(w).to(b_g.dtype), b_g)
            gv = tl.dot(b_g, tl.trans(b_v))
            dx = gv * (c1 + 2.0 * c2 * x) + b_h[:, None] * b_m[None, :] * (d1 + 2.0 * d2 * x)
            b_dk += tl.dot(tl.trans(tl.where(causal, dx, 0.0)).to(b_q.dtype), b_q)
            b_p1 += tl.dot(tl.trans(b_q), b_g)
            b_p1h += tl.sum(b_q.to(tl.float32) * b_h[:, None], 0)
            b_p0 += tl.sum(b_g.to(tl.float32), 0)
            tl.atomic_add(dk_base + rows[:, None] * D + o_d[None, :], b_dk, mask=live[:, None])
        dv_rows = DV_OUT + i_bh * N * DV + rows[:, None] * DV + o_v[None, :]
        tl.atomic_add(dv_rows, b_dv, mask=live[:, None])
