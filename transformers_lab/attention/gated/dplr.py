"""The diagonal-plus-low-rank (DPLR) recurrence, RWKV-7's: a decay per key channel and a
rank-one update of the state, both applied to the state before the token, then its write.

One state S (B, H, Dk, Dv) per sequence, and per token t, with w_t <= 0 the log decay of
each key channel (B, H, N, Dk) and alpha_t, beta_t (B, H, N, Dk):

    S_t = Diag(exp(w_t)) S_{t-1} + beta_t (alpha_t^T S_{t-1}) + k_t v_t^T,
    o_t = S_t^T (scale * q_t)

so the transition is Diag(exp(w_t)) + beta_t alpha_t^T (fla's ``generalized_delta_rule/dplr``;
RWKV-7 takes alpha = -kappa, beta = kappa * a, kappa its normalised key). The delta rule is
the case alpha = -k, beta = beta k, with no decay; there it writes k and v first and reads
after, where DPLR reads S_{t-1}.

Two paths, equal to rounding:

- ``naive_dplr``: token by token, the reference (run in float64 by the tests) and the
  decode step;
- ``chunked_dplr``: chunks of C tokens. With b_t the cumulative log decay since the
  chunk's start and u_s = alpha_s^T S_{s-1} (what the low-rank part reads, a Dv row),

      u_s = (alpha_s e^{b_{s-1}})^T S_0 + sum_{r<s} A_ak[s, r] v_r + A_ab[s, r] u_r,
      o_t = (q_t e^{b_t})^T S_0 + sum_{r<=t} A_qk[t, r] v_r + A_qb[t, r] u_r,

  with the decayed scores A_xy[t, r] = x_t . (y_r e^{b_t - b_r}) (the alpha rows read
  at b_{s-1}: alpha_s e^{-w_s} against b_s), so U solves the unit-lower triangular system
  (I - A_ab) U = A_ak V + (alpha e^{b - w}) S_0: U = t_v + t_s S_0 for each chunk's start
  state S_0, and the state moves to the chunk's end by
  S' = (Diag(e^{b_C}) + B'^T t_s) S + K'^T V + B'^T t_v, K' and B' the keys and betas
  decayed to the chunk's end. The chunk loop only carries S; the rest is batched over the
  chunks. The scores are ``channel_decayed_scores``' (one product a chunk where its decay
  spans at most e^-80 in a channel, by blocks otherwise); alpha e^{-w} asks each token's
  decay to be at least e^-40 (RWKV-7's is at least e^-0.61).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.gated.recurrence import HALF, channel_decayed_scores

# alpha e^{-w}: a token's own decay is undone in the low-rank rows' factor, kept finite
MAX_TOKEN_DECAY = 40.0


def check_dplr(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, alpha: Tensor, beta: Tensor):
    """One line naming the tensor whose shape or value does not fit."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q and k must be (B, H, N, Dk) and v (B, H, N, Dv), got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    for name, t in (("the log-decay", log_decay), ("alpha", alpha), ("beta", beta)):
        if t.shape != q.shape:
            raise ValueError(
                f"{name} must be (B, H, N, Dk) = {tuple(q.shape)}, got {tuple(t.shape)}"
            )
    ok = (log_decay <= 0) & (log_decay >= -MAX_TOKEN_DECAY)
    if not bool(ok.all()):
        bad = log_decay[~ok].flatten()[0].item()
        raise ValueError(
            f"the log-decay must be in [-{MAX_TOKEN_DECAY:g}, 0] (a decay a token in "
            f"[e^-{MAX_TOKEN_DECAY:g}, 1]), got {bad}: pass log(w), not w"
        )


def naive_dplr(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    alpha: Tensor,
    beta: Tensor,
    *,
    scale: float = 1.0,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The recurrence token by token: (o (B, H, N, Dv), the state after the last token)."""
    check_dplr(q, k, v, log_decay, alpha, beta)
    b, h, n, dk = q.shape
    s = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state
    out = []
    for t in range(n):
        read = (alpha[:, :, t, :, None] * s).sum(-2)  # alpha^T S_{t-1}: (B, H, Dv)
        s = (
            s * log_decay[:, :, t, :, None].exp()
            + beta[:, :, t, :, None] * read[..., None, :]
            + k[:, :, t, :, None] * v[:, :, t, None, :]
        )
        out.append(((scale * q[:, :, t])[..., None] * s).sum(-2))
    return torch.stack(out, 2), s


def chunked_dplr(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    alpha: Tensor,
    beta: Tensor,
    *,
    scale: float = 1.0,
    state: Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[Tensor, Tensor]:
    """``naive_dplr`` in chunks of ``chunk_size`` tokens (the module doc); the same
    (o, state)."""
    check_dplr(q, k, v, log_decay, alpha, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    c = min(chunk_size, n)
    pad = -n % c  # padded tokens: no key, no value, no decay, no low-rank part
    if pad:
        q, k, v, log_decay, alpha, beta = (
            F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, log_decay, alpha, beta)
        )
    nc = (n + pad) // c

    def chunks(t: Tensor) -> Tensor:
        return t.reshape(b, h, nc, c, t.shape[-1])

    qc, kc, vc, wc, ac, bc = (chunks(t) for t in (scale * q, k, v, log_decay, alpha, beta))
    cum = wc.cumsum(3)  # b_t
    last = cum[:, :, :, -1:]  # b_C
    a_prev = ac * (-wc).exp()  # alpha_s read at b_{s-1}: alpha_s e^{-w_s} against b_s
    qk, ak = channel_decayed_scores((qc, a_prev), kc, cum)
    qb, ab = channel_decayed_scores((qc, a_prev), bc, cum)
    ak, ab = ak.tril(-1), ab.tril(-1)  # u_s reads the tokens before s
    # U = t_v + t_s S0: (I - A_ab) [t_v, t_s] = [A_ak V, alpha e^{b - w}], one solve
    eye = torch.eye(c, dtype=ab.dtype, device=ab.device)
    rhs = torch.cat([ak @ vc, a_prev * cum.exp()], -1)
    low = rhs.dtype in HALF
    solved = torch.linalg.solve_triangular(
        (eye - ab).float() if low else eye - ab, rhs.float() if low else rhs, upper=False,
        unitriangular=True,
    ).to(rhs.dtype)  # fmt: skip
    t_v, t_s = solved.split([dv, dk], -1)
    k_out, b_out = kc * (last - cum).exp(), bc * (last - cum).exp()
    # S' = M S + W, M = Diag(e^{b_C}) + B'^T t_s, W = K'^T V + B'^T t_v
    carry = torch.diag_embed(last.squeeze(3).exp()) + b_out.mT @ t_s
    written = k_out.mT @ vc + b_out.mT @ t_v
    s = q.new_zeros(b, h, dk, dv) if state is None else state
    chain = [s]
    for m, w in zip(carry.unbind(2), written.unbind(2), strict=True):
        chain.append(torch.matmul(m, chain[-1]) + w)
    starts = torch.stack(chain[:-1], 2)  # (B, H, nc, Dk, Dv)
    u = t_v + t_s @ starts
    o = (qc * cum.exp()) @ starts + qk @ vc + qb @ u
    return o.reshape(b, h, nc * c, dv)[:, :, :n], chain[-1]
