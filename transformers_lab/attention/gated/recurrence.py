"""The gated recurrence: linear attention with a decay and the delta rule, chunked.

One state S (B, H, Dk, Dv) per sequence, and per token t, with a_t = exp(g_t):

    S_t = a_t * S_{t-1} + k_t u_t^T,   o_t = S_t^T (scale * q_t)

- the decay g_t (a log, <= 0) is none (a_t = 1), one number per head and token (B, H, N):
  RetNet's fixed gamma, Mamba2's and fla's ``simple_gla``, or one per key channel
  (B, H, N, Dk): GLA's, which multiplies row d of S by a_t[d];
- without the delta rule u_t = v_t; with it (DeltaNet), u_t = beta_t (v_t - S'^T k_t), the
  value written minus what the decayed state S' = a_t S_{t-1} already gives for k_t: the
  state's prediction for k_t moves towards v_t by beta_t. It takes either decay: one per
  head and token (Gated DeltaNet) or one per key channel (KDA).

Two paths, equal to rounding:

- ``naive_recurrence``: token by token, the reference (run in float64 by the tests), and
  the decode step (``recurrent_step``): O(1) work per token;
- ``chunked_recurrence``: chunks of C tokens. Inside a chunk, with b_t the cumulative log
  decay since the chunk's start, a query reads the state of the chunk's start through
  q_t * exp(b_t) and the chunk's own keys through the decayed scores
  (q_t . k_s) exp(b_t - b_s), s <= t; the state moves to the chunk's end through
  exp(b_C) and keys weighed by exp(b_C - b_s). In float32 or float64 the scores are one
  product, (q_t exp(b_t - r)) . (k_s exp(r - b_s)): for a decay per head and token with
  r = 0 where no chunk decays by more than e^-60, every factor within e^+-60; for one per
  key channel with r the middle of each chunk's range where no chunk spans more than
  e^-80 in any channel, every factor within e^+-40. One chunk past its bound, anywhere in
  the call, sends the whole call to the second form, where every factor exponentiates a
  difference that is <= 0, so nothing overflows whatever the decay: a decay per head and
  token through the (C x C) factor exp(b_t - b_s); a decay per key channel, which has no
  such factor, block by block (sub-chunks of 8), between blocks through a reference
  point that keeps both factors <= 1, inside a diagonal block as one product about the
  block's middle where it spans e^-80 or less, else as the explicit (8 x 8 x Dk) sum.
  The delta rule is chunked through the WY representation: the pseudo-values U of a
  chunk solve (I + A) U = diag(beta) (V - diag(exp(b)) K S0), with A the strictly lower
  beta_t exp(b_t - b_s) (k_t . k_s) (per key channel: beta_t k_t . (k_s exp(b_t - b_s)),
  the keys' decayed scores, as the queries' are); with T = (I + A)^-1 diag(beta), T V and
  T diag(exp(b)) K come from one unit-lower triangular solve a chunk, and
  U = T V - (T diag(exp(b)) K) S0 for each chunk's start state S0.

The chunk loop only carries the state from chunk to chunk, S' = M S + W: what each chunk
writes (W) and carries over (M: its decay, and under the delta rule a Dk x Dk matrix) and
the outputs from the chunk-start states are batched over all chunks. Gradients come from
autograd (the states of the chunk starts are kept: N / C x Dk x Dv numbers a head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)  # no triangular solve in these: it runs in float32
WIDE = (torch.float32, torch.float64)  # the one-product scores' e^+-60 factors: not in half
# the blocks of a per-channel decay's scores inside a chunk that spans more than
# e^-CHANNEL_SPAN: 8 took the least time of 4 to 64 in chunks of 16, 32 and 64 (forward and
# backward on the CPU, Dk 8: 101, 144 and 263 ms, where blocks of 16 took 194, 259, 319)
SUB_CHUNK = 8
# a decay per head and token whose chunks all decay by at most e^-SAFE_SPAN takes the
# one-product path: q exp(b) and k exp(-b) stay inside [e^-60, e^60], far from float32's limits
SAFE_SPAN = 60.0
# a per-channel decay's one product, its factors taken about each chunk's middle, where no
# chunk spans more than e^-CHANNEL_SPAN in a channel: every entry within e^80 (float32: e^88)
CHANNEL_SPAN = 80.0


def check_shapes(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, beta: Tensor | None):
    """One line naming the tensor whose shape does not fit q, k and v's (B, H, N, D)."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q and k must be (B, H, N, Dk) and v (B, H, N, Dv), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if log_decay is not None and log_decay.shape not in (q.shape[:3], q.shape):
        raise ValueError(
            f"the log-decay must be (B, H, N) or (B, H, N, Dk) = {tuple(q.shape[:3])} or "
            f"{tuple(q.shape)}, got {tuple(log_decay.shape)}"
        )
    if log_decay is not None and not bool(((log_decay <= 0) & log_decay.isfinite()).all()):
        bad = log_decay[~((log_decay <= 0) & log_decay.isfinite())].flatten()[0].item()
        raise ValueError(
            f"the log-decay must be finite and <= 0 (a decay in (0, 1]), got {bad}: pass "
            "log(alpha), e.g. F.logsigmoid(x), not alpha itself"
        )
    if beta is not None and beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be (B, H, N) = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")


def decay_state(state: Tensor, a: Tensor) -> Tensor:
    """a * S: a is (B, H) (a number a head) or (B, H, Dk) (a row of S each)."""
    return state * (a[..., None, None] if a.dim() == 2 else a[..., None])


def naive_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    scale: float | None = None,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The recurrence token by token: (o (B, H, N, Dv), the state after the last token
    (B, H, Dk, Dv)). ``scale``: what q is multiplied by (None: Dk ** -0.5)."""
    check_shapes(q, k, v, log_decay, beta)
    b, h, n, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    s = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state
    out = []
    for t in range(n):
        if log_decay is not None:
            s = decay_state(s, log_decay[:, :, t].exp())
        kt, ut = k[:, :, t], v[:, :, t]
        if beta is not None:  # write beta (v - what the state reads for k)
            ut = beta[:, :, t, None] * (ut - (kt[..., None] * s).sum(-2))
        s = s + kt[..., None] * ut[..., None, :]
        out.append(((scale * q[:, :, t])[..., None] * s).sum(-2))
    return torch.stack(out, 2), s


recurrent_step = naive_recurrence  # decoding: a few new tokens against the state


def chunked_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    scale: float | None = None,
    state: Tensor | None = None,
    chunk_size: int = 64,
    read_every: int = 1,
) -> tuple[Tensor, Tensor]:
    """``naive_recurrence`` in chunks of ``chunk_size`` tokens (see the module doc); the
    same (o, state).

    ``read_every`` = m > 1: only the outputs of steps m - 1, 2m - 1, ... (B, H, N / m, Dv),
    the other steps' queries zero and never read (Gated DeltaProduct's m keys a token,
    its query after the last): the queries' products are formed for those rows alone, and
    the chunks are a multiple of m steps."""
    check_shapes(q, k, v, log_decay, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, h, n, dk = q.shape
    every = read_every
    if every < 1 or n % every:
        raise ValueError(f"read_every must be >= 1 and divide the {n} steps, got {every}")
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    c = min(max(chunk_size // every, 1) * every, n)
    pad = -n % c  # padded tokens: no key, no value, no decay; their outputs are dropped
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        if log_decay is not None:
            log_decay = F.pad(log_decay, (0, 0, 0, pad) if log_decay.dim() == 4 else (0, pad))
        if beta is not None:
            beta = F.pad(beta, (0, pad))
    nc = (n + pad) // c
    qc, kc, vc = (t.reshape(b, h, nc, c, t.shape[-1]) for t in (scale * q, k, v))
    mask = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    rows = slice(every - 1, None, every)  # the steps whose outputs are read (all for 1)
    all_q, qc, below = qc, qc[..., rows, :], mask[rows]  # (.., C / every, Dk), (C / every, C)
    per_channel = log_decay is not None and log_decay.dim() == 4
    if log_decay is None:
        scores = (qc @ kc.mT).masked_fill(~below, 0.0)
        q_in, k_out, a_end = qc, kc, None
    else:
        cum = log_decay.reshape(b, h, nc, c, *log_decay.shape[3:]).cumsum(3)  # b_t
        last = cum[:, :, :, -1:]  # b_C
        if per_channel:  # the delta rule's keys read the keys as the queries do
            queries = (all_q, kc) if beta is not None else (all_q,)  # square blocks
            reads = channel_decayed_scores(queries, kc, cum)
            scores = reads[0][..., rows, :]
            q_in, k_out, decay = qc * cum[..., rows, :].exp(), kc * (last - cum).exp(), None
        else:
            q_in, k_out = qc * cum[..., rows, None].exp(), kc * (last - cum)[..., None].exp()
            if folds(cum):  # exp(b_t - b_s) = exp(b_t) exp(-b_s): in q_in and k_in
                k_in, decay = kc * (-cum)[..., None].exp(), None
                scores = (q_in @ k_in.mT).masked_fill_(~below, 0.0)
            else:  # (B, H, nc, C, C): the scores' and the WY form's
                decay = pair_decay(cum, mask)
                scores = (qc @ kc.mT) * decay[..., rows, :]
        a_end = last.squeeze(3).exp()  # (B, H, nc) or (B, H, nc, Dk)
    if beta is not None:  # the WY form: U = t_v - t_k S0 for each chunk's start state S0
        betac = beta.reshape(b, h, nc, c)
        # k' = k exp(b_t), the keys decayed since the chunk's start (k itself without decay)
        k_dec = kc if log_decay is None else kc * (cum if per_channel else cum[..., None]).exp()
        # A: beta_t exp(b_t - b_s) (k_t . k_s) (per key channel: beta_t (k_t . k_s exp(b_t -
        # b_s))), its strictly lower part the only part the solve reads (or sends gradient
        # to): no mask
        if log_decay is None:
            a = (betac[..., None] * kc) @ kc.mT
        elif per_channel:  # KDA's: the keys' own decayed scores, as the queries'
            a = betac[..., None] * reads[1]
        elif decay is None:
            a = (betac[..., None] * k_dec) @ k_in.mT
        else:
            a = ((betac[..., None] * kc) @ kc.mT) * decay
        # T V and T K' with T = (I + A)^-1 diag(beta): one unit-lower triangular solve of
        # both (C^2 (Dk + Dv) work a chunk, where forming T takes log2(C) C^3 products)
        rhs = betac[..., None] * torch.cat([vc, k_dec], -1)
        low = a.dtype in HALF
        solved = torch.linalg.solve_triangular(
            a.float() if low else a, rhs.float() if low else rhs, upper=False, unitriangular=True
        ).to(rhs.dtype)
        t_v, t_k = solved.split([dv, dk], -1)
    s = q.new_zeros(b, h, dk, dv) if state is None else state
    # the chunk-to-chunk recursion of the state, S' = M S + W, is all the loop does: what a
    # chunk writes (W) and how it carries the state over (M) are batched over the chunks,
    # and so are the outputs from the chunk-start states after it
    written = k_out.mT @ (vc if beta is None else t_v)  # (B, H, nc, Dk, Dv)
    if beta is None and a_end is None:  # S' = S + W: prefix sums
        ends = s[:, :, None] + written.cumsum(2)
        starts = torch.cat([s[:, :, None], ends[:, :, :-1]], 2)
        s = ends[:, :, -1]
    else:
        if beta is not None:  # S' = a S - K'^T (T K'' S) + W: a (Dk x Dk) carry a chunk
            carry = -(k_out.mT @ t_k)
            if a_end is not None:  # its decay on the diagonal: a number a head or a row each
                diagonal = a_end if per_channel else a_end[..., None].expand(*a_end.shape, dk)
                carry = carry + torch.diag_embed(diagonal)
            else:
                carry = carry + torch.eye(dk, dtype=carry.dtype, device=carry.device)
            factors = carry.unbind(2)
        else:  # S' = a S + W, a number a head or a row of S each
            factors = (a_end[..., None, None] if a_end.dim() == 3 else a_end[..., None]).unbind(2)
        chain = [s]
        for m, w in zip(factors, written.unbind(2), strict=True):
            prev = chain[-1]
            chain.append(
                torch.matmul(m, prev) + w if beta is not None else torch.addcmul(w, m, prev)
            )
        starts = torch.stack(chain[:-1], 2)  # (B, H, nc, Dk, Dv): each chunk's start state
        s = chain[-1]
    u = vc if beta is None else t_v - t_k @ starts
    o = (q_in @ starts + scores @ u).reshape(b, h, nc * c // every, dv)
    return o[:, :, : n // every], s


def folds(cum: Tensor) -> bool:
    """Whether a chunk's decayed scores may be one product, (q_t exp(b_t)) . (k_s exp(-b_s)),
    for the cumulative log decay per head and token ``cum`` (..., C): in float32 or float64
    (e^+-60 overflows half precision), where no chunk decays by more than e^-SAFE_SPAN,
    so every factor stays within e^+-SAFE_SPAN."""
    return cum.dtype in WIDE and bool((cum.detach() >= -SAFE_SPAN).all())


def pair_decay(cum: Tensor, mask: Tensor) -> Tensor:
    """exp(b_t - b_s) for s <= t (zeros above the diagonal), of the cumulative log decay
    ``cum`` (..., C): differences that are <= 0, exponentiated after masking."""
    diff = cum[..., :, None] - cum[..., None, :]
    return diff.masked_fill(~mask, -math.inf).exp()


def channel_decayed_scores(queries: tuple[Tensor, ...], kc: Tensor, cum: Tensor) -> list[Tensor]:
    """(q_t . (k_s * exp(b_t - b_s))) for s <= t, zeros above, for each of ``queries``
    (the queries, and under the delta rule the keys too, which share the keys' factors):
    a decay per key channel, q, k and cum (..., C, Dk).

    In float32 or float64, where no chunk's cumulative decay spans more than
    CHANNEL_SPAN in any channel, one product per chunk, (q_t exp(b_t - r)) .
    (k_s exp(r - b_s)), r the middle of the chunk's range in that channel: each factor
    within e^+-CHANNEL_SPAN/2, and every entry of the product, the discarded ones above
    the diagonal included, within e^CHANNEL_SPAN, below float32's e^88. GLA's gates learn
    to forget fast: in MAD's fuzzy recall a chunk of 16 spans e^-62 after nine epochs.
    Otherwise block by block (``scores_by_blocks``). Both are exact."""
    c = kc.shape[-2]
    first, last = cum[..., :1, :], cum[..., -1:, :]  # the chunk's range: cum decreases
    if cum.dtype in WIDE and bool(((first - last).detach() <= CHANNEL_SPAN).all()):
        ref = (first + last).detach() / 2
        lower = torch.ones(c, c, dtype=torch.bool, device=kc.device).tril()
        keys = kc * (ref - cum).exp()
        up = (cum - ref).exp()
        return [((q * up) @ keys.mT).masked_fill_(~lower, 0.0) for q in queries]
    return scores_by_blocks(queries, kc, cum)


def scores_by_blocks(queries: tuple[Tensor, ...], kc: Tensor, cum: Tensor) -> list[Tensor]:
    """``channel_decayed_scores`` block by block (``SUB_CHUNK`` tokens), for any decay,
    batched over the blocks.

    A query after key block j reads it through r_j, the cumulative decay at the end of
    block j: (q_t exp(b_t - r_j)) . (k_s exp(r_j - b_s)), both factors <= 1 (the queries'
    factor clamped at 1 where t is not after block j, whose entries are dropped). A block
    on the diagonal is one product about the block's middle, as a chunk's, where no block
    spans more than CHANNEL_SPAN in a channel (in float32 or float64), else the explicit
    (S x S x Dk) sum of exp(b_t - b_s) <= 1."""
    c = kc.shape[-2]
    sub = SUB_CHUNK if c % SUB_CHUNK == 0 else c
    m = c // sub
    k4, cum4 = (t.unflatten(-2, (m, sub)) for t in (kc, cum))  # (..., m, S, Dk)
    tri = torch.ones(sub, sub, dtype=torch.bool, device=kc.device).tril()
    first, last = cum4[..., :1, :], cum4[..., -1:, :]
    if cum.dtype in WIDE and bool(((first - last).detach() <= CHANNEL_SPAN).all()):
        mid = (first + last).detach() / 2
        keys, rise = k4 * (mid - cum4).exp(), (cum4 - mid).exp()

        def diagonal(q4: Tensor) -> Tensor:  # (..., m, S, S)
            return (q4 * rise) @ keys.mT
    else:
        diff = cum4[..., :, None, :] - cum4[..., None, :, :]  # (..., m, S, S, Dk)
        decay = diff.masked_fill(~tri[..., None], -math.inf).exp()

        def diagonal(q4: Tensor) -> Tensor:
            return (q4[..., :, None, :] * k4[..., None, :, :] * decay).sum(-1)

    if m == 1:
        return [
            diagonal(q.unflatten(-2, (m, sub))).masked_fill(~tri, 0.0).squeeze(-3) for q in queries
        ]
    ref = last.detach()  # (..., m, 1, Dk): r_j
    k_r = k4 * (ref - cum4).exp()  # (..., m, S, Dk)
    up = (cum.unsqueeze(-3) - ref).clamp(max=0.0).exp()  # (..., m, C, Dk)
    block = torch.arange(m, device=kc.device)
    later = (block[:, None] > block[None, :])[:, None, :, None]  # query block after key block
    eye = (block[:, None] == block[None, :])[:, None, :, None]
    out = []
    for q in queries:
        off = ((q.unsqueeze(-3) * up) @ k_r.mT).unflatten(-2, (m, sub))  # (..., m_j, m_i, S, S)
        off = off.movedim(-4, -2)  # (..., m_i, S_t, m_j, S_s)
        diag = diagonal(q.unflatten(-2, (m, sub))).masked_fill(~tri, 0.0)
        scores = off.masked_fill(~later, 0.0) + diag.unsqueeze(-2) * eye
        out.append(scores.reshape(*q.shape[:-2], c, c))
    return out


def unit_lower_inverse(a: Tensor) -> Tensor:
    """(I + A)^-1 for strictly lower triangular A (..., C, C), by matrix products: A is
    nilpotent, so (I + A)^-1 = sum_j (-A)^j = (I - A)(I + A^2)(I + A^4)... up to A^C."""
    c = a.shape[-1]
    power = -a
    inverse = torch.eye(c, dtype=a.dtype, device=a.device) + power
    reach = 2  # the inverse holds the powers below ``reach``
    while reach < c:
        power = power @ power
        inverse = inverse + inverse @ power
        reach *= 2
    return inverse
