"""RWKV-7 "Goose" (Peng et al., "RWKV-7 Goose with Expressive Dynamic State Evolution",
2025): the DPLR recurrence with a decay per key channel and a rank-one update from the
token's own normalised key, on ``gated.dplr``.

    kappa = normalize(k * k_k),  k' = k * (1 + (a - 1) * k_a),
    S_t = Diag(exp(w_t)) S_{t-1} - (kappa_t * a_t) (kappa_t^T S_{t-1}) + k'_t v_t^T,
    o_t = S_t^T r_t + (r_t . (k'_t * r_k)) v_t

with r the query, log w_t = -e^{-1/2} sigmoid(w(x) + w_bias) per key channel (at most
e^-0.61 a token) and a = sigmoid(a(x)) in (0, 1), a per key channel: the state removes a of
what it holds for kappa before writing k' v^T (fla's ``fla/layers/rwkv7.py`` and
``fla/ops/generalized_delta_rule/dplr/naive.py``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformers_lab.attention.backends import choose, compute_dtype
from transformers_lab.attention.base import GateInput
from transformers_lab.attention.fla_ops import fla_dplr
from transformers_lab.attention.gated.dplr import chunked_dplr, naive_dplr
from transformers_lab.attention.gated.kernel import GatedKernel, at_least_float32
from transformers_lab.attention.gated.recurrence import HALF  # what ``auto`` hands fla's op
from transformers_lab.errors import must_be

DECAY_FLOOR = math.exp(-0.5)  # log w = -e^{-1/2} sigmoid(.): RWKV-7's bound, w >= e^-0.61


class RWKV7Attention(GatedKernel):
    """RWKV-7's time mixing: a decay and an in-context rate per key channel, from x.

    Its gate inputs come from x through bottlenecks ``gate_rank`` wide (RWKV-7's LoRAs):
    ``w`` the decay's, ``a`` the in-context rate's, one number per head, token and key
    channel. Its own parameters, one per head and key channel: ``w_bias`` (the decay's
    bias, from -5.5 to 0.5 across a head's channels as RWKV-7's initialisation spreads it:
    log w from -0.0025 a token, slow forgetting, to -0.38, fast), ``k_k`` (kappa's scale,
    0.71), ``k_a`` (how much a shrinks the written key, 1.02) and ``r_k`` (the bonus, the
    token's own value read by r . k' r_k, -0.04). The queries are scaled by 1/sqrt(D), as
    every kernel's here, where RWKV-7's scale is 1: the output is linear in r, and the
    per-head norm of its layer takes the scale out.

    Args:
        gate_rank: the width of the gate inputs' bottlenecks (32: fla's floor).
        chunk_size: tokens of a chunk of the chunked path.
        backend: ``auto`` (fla's DPLR kernel on CUDA where installed, in bf16 or fp16: fla
            warns its float32 may be wrong on some GPUs, so float32 takes our loop),
            ``loop`` (our chunked DPLR loop) or ``fla`` (``fla_ops.fla_dplr``: the op
            under fla's ``chunk_rwkv7``).
    """

    name = "rwkv7"
    delta_rule = True
    # a key's read of the state, and its two writes (the a-term and k' v^T)
    state_products_per_key = 3
    formula = "S ← Diag(w)S − κ̂a(κ̂ᵀS) + k′vᵀ, o = (Sᵀr + (r·k′r_k)v)/√d, w, a per channel, causal"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        gate_rank: int = 32,
        chunk_size: int = 32,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout, chunk_size, backend)
        if isinstance(gate_rank, bool) or not (isinstance(gate_rank, int) and gate_rank >= 1):
            raise ValueError(f"{self.name}: {must_be('gate_rank', 'an integer >= 1', gate_rank)}")
        self.gate_rank = gate_rank
        self.gate_inputs = {
            "w": GateInput("identity", per_channel=True, rank=gate_rank),
            "a": GateInput("sigmoid", per_channel=True, rank=gate_rank),
        }
        spread = torch.linspace(0, 1, head_dim) if head_dim > 1 else torch.ones(1)
        self.w_bias = nn.Parameter((-6 + 6 * spread + 0.5).repeat(n_head, 1))
        self.k_k = nn.Parameter(torch.full((n_head, head_dim), 0.71))
        self.k_a = nn.Parameter(torch.full((n_head, head_dim), 1.02))
        self.r_k = nn.Parameter(torch.full((n_head, head_dim), -0.04))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gate_rank={self.gate_rank}"

    # ------------------------------------------------------------ the recurrence's inputs

    def dplr_inputs(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor | None,
        causal: bool,
        key_padding_mask: Tensor | None,
        gates: dict[str, Tensor],
    ) -> tuple[Tensor, ...]:
        """q, k', v, log w, alpha = -kappa, beta = kappa a and the bonus r . (k' r_k) a
        token, as the DPLR recurrence takes them, one query a key (the queries aligned to
        the last keys, missing ones zero), padded keys writing nothing and decaying
        nothing; and how many leading outputs to drop."""
        self.check_call(causal, gates)
        q, k = self.mapped(q, "q"), self.mapped(k, "k")
        a = gates["a"]
        bias = self.w_bias[:, None, :].to(k)
        log_w = -DECAY_FLOOR * torch.sigmoid(gates["w"] + bias)
        kappa = F.normalize(k * self.k_k[:, None, :].to(k), dim=-1)
        k = k * (1 + (a - 1) * self.k_a[:, None, :].to(k))
        alpha, beta = -kappa, kappa * a
        nq, nk = q.shape[2], k.shape[2]
        front, skip = max(0, nq - nk), max(0, nk - nq)

        def before(t: Tensor, tokens: int) -> Tensor:  # ``tokens`` zero tokens first
            return F.pad(t, (0, 0, tokens, 0))

        k, log_w, alpha, beta = (before(t, front) for t in (k, log_w, alpha, beta))
        v = None if v is None else before(v, front)
        q = before(q, skip)
        if key_padding_mask is not None:
            keep = ~F.pad(key_padding_mask, (front, 0), value=True)[:, None, :, None]
            k, log_w, beta = k * keep, log_w * keep, beta * keep
            v = None if v is None else v * keep
        bonus = (self.scale * q * k * self.r_k[:, None, :].to(k)).sum(-1)  # (B, H, N)
        return q, k, v, log_w, alpha, beta, bonus, skip

    # ------------------------------------------------------------ the contract

    def forward(  # type: ignore[override]
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> Tensor:
        self.check_inputs(q, k, v, key_padding_mask)
        fla = choose(self.backend, self.fused_backends, q.device) == "fla"
        fused_dtype = compute_dtype(v)  # autocast's (bf16-mixed) or the inputs' own
        if fla and self.backend == "auto" and fused_dtype not in HALF:
            fla = False  # fla warns its DPLR op may be wrong in float32 on some GPUs
        with torch.autocast(q.device.type, enabled=False):
            dtype = v.dtype
            q, k, v, gates = in_float32(q, k, v, gates)
            q, k, v, log_w, alpha, beta, bonus, skip = self.dplr_inputs(
                q, k, v, causal, key_padding_mask, gates
            )
            if fla:
                fq, fk, fv, fa, fb = (t.to(fused_dtype) for t in (q, k, v, alpha, beta))
                out = fla_dplr(fq, fk, fv, log_w, fa, fb, scale=self.scale).to(v.dtype)
            else:
                out, _ = chunked_dplr(
                    q, k, v, log_w, alpha, beta, scale=self.scale, chunk_size=self.chunk_size
                )
            out = out + bonus[..., None] * v
        return out[:, :, skip:].to(dtype)

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> Tensor:
        """The (B, H, Nq, Nk) matrix with ``forward == weights @ v``: the decayed scores of
        the queries over the keys, A_qk + A_qb (I - A_ab)^-1 A_ak over the whole sequence
        (``gated.dplr``'s module doc), and the bonus on the diagonal."""
        self.check_inputs(q, k, None, key_padding_mask)
        nk = k.shape[2]
        q, k, _, log_w, alpha, beta, bonus, skip = self.dplr_inputs(
            q, k, None, causal, key_padding_mask, gates
        )
        q, k, log_w, alpha, beta, bonus = at_least_float32(q, k, log_w, alpha, beta, bonus)
        n = k.shape[2]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        cum = log_w.cumsum(2)
        diff = cum[:, :, :, None] - cum[:, :, None, :]  # (B, H, N, N, Dk): b_t - b_s
        decay = diff.masked_fill(~lower[..., None], float("-inf")).exp()
        a_prev = alpha * (-log_w).exp()  # alpha_s read at b_{s-1}

        def scores(x: Tensor, y: Tensor) -> Tensor:  # x_t . (y_s e^{b_t - b_s}), s <= t
            return (x[:, :, :, None] * y[:, :, None] * decay).sum(-1)

        a_ak, a_ab = scores(a_prev, k).tril(-1), scores(a_prev, beta).tril(-1)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        reads = torch.linalg.solve_triangular(eye - a_ab, a_ak, upper=False, unitriangular=True)
        w = scores(self.scale * q, k) + scores(self.scale * q, beta) @ reads
        w = w + torch.diag_embed(bonus)
        return w[:, :, skip:, n - nk :]

    def reference_weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> Tensor:
        """The weights read from the token-by-token recurrence in float64, fed the one-hot
        value of each key, and the bonus r . (k' r_k) v of each token's own."""
        self.check_inputs(q, k, None, key_padding_mask)
        q, k = q.double(), k.double()
        gates = {name: g.double() for name, g in gates.items()}
        nk = k.shape[2]
        onehot = torch.eye(nk, dtype=torch.float64).expand(*k.shape[:2], nk, nk)
        q, k, v, log_w, alpha, beta, bonus, skip = self.dplr_inputs(
            q, k, onehot, causal, key_padding_mask, gates
        )
        out, _ = naive_dplr(q, k, v, log_w, alpha, beta, scale=self.scale)
        return (out + bonus[..., None] * v)[:, :, skip:]

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """T new tokens against the state (B, H, Dk, Dv): the recurrence for one token,
        the chunked path for more; the state's size never grows."""
        self.check_inputs(q, k, v, key_padding_mask)
        self.check_decode_tokens(q, k)
        with torch.autocast(q.device.type, enabled=False):
            dtype = v.dtype
            q, k, v, gates = in_float32(q, k, v, gates)
            q, k, v, log_w, alpha, beta, bonus, _ = self.dplr_inputs(
                q, k, v, True, key_padding_mask, gates
            )
            state = None if state is None else state.to(q.dtype)
            run: Any = naive_dplr if q.shape[2] == 1 else chunked_dplr
            options = {} if q.shape[2] == 1 else {"chunk_size": self.chunk_size}
            out, state = run(q, k, v, log_w, alpha, beta, scale=self.scale, state=state, **options)
            out = out + bonus[..., None] * v
        return out.to(dtype), state


def in_float32(
    q: Tensor, k: Tensor, v: Tensor, gates: dict[str, Tensor]
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """q, k, v and the gate inputs in float32 where they are in half precision
    (``at_least_float32``): the state accumulates."""
    q, k, v, *values = at_least_float32(q, k, v, *gates.values())
    return q, k, v, dict(zip(gates, values, strict=True))
