"""The module every gated kernel is: ``GatedKernel``, on the gated recurrence
(``recurrence``).

A gated kernel keeps one state S (B, H, Dk, Dv) a sequence and, token by token, decays it
and writes its key and value (``recurrence``'s module doc): RetNet, GLA, Mamba2's scalar decay
(``simple_gla``), DeltaNet and Gated DeltaNet. A subclass says how its decay and its
delta-rule rate come from its gate inputs (``decay_and_rate``), and may map q and k first
(``feature_map``: elu + 1, relu, an L2 norm); training runs the chunked path, decoding the
recurrence, O(1) a token.

Such a kernel reads the sequence in order, so it is causal only: a non-causal call (an
encoder, a cross-attention) is refused (``causal_only``). Its weights are not
normalised over the keys (the layer's output norm, ``attention.output_norm``, scales the
output instead), and are explicit: ``weights`` gives the (Nq, Nk) matrix with
``forward == weights @ v``, and ``reference_weights`` reads it from the token-by-token
recurrence in float64, fed one-hot values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformers_lab.attention import fla_ops
from transformers_lab.attention.backends import check_backend, choose, compute_dtype
from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.gated.recurrence import (
    HALF,
    chunked_recurrence,
    naive_recurrence,
    pair_decay,
)
from transformers_lab.errors import must_be


class GatedKernel(AttentionKernel):
    """Base of the gated kernels (see the module doc).

    Args:
        chunk_size: C, the tokens of a chunk of the chunked path.
        dropout: not supported (0 only): a gated state has no weights to drop.
        backend: what trains (``attention.backends``): ``auto`` (fla's kernel on CUDA where
            installed, our chunk loop elsewhere), ``loop`` (our chunk loop, any device;
            null too) or ``fla``, fla's Triton kernel for the same recurrence (``fla_ops``;
            its own chunk size, not ``chunk_size``). Decoding runs our recurrence either
            way.
    """

    normalized = False
    constant_state = True
    causal_only = True
    fused_backends = ("fla",)
    delta_rule = False  # reads each key's old value from the state before writing it

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        chunk_size: int = 64,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout)
        if dropout:
            raise ValueError(
                f"{self.name}: dropout={dropout} is not supported (its state has no attention "
                "weights to drop); use the model's dropout"
            )
        if not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ValueError(f"{self.name}: {must_be('chunk_size', 'an integer >= 1', chunk_size)}")
        self.chunk_size = chunk_size
        self.backend = check_backend(self.name, backend, self.fused_backends)
        self.scale = head_dim**-0.5

    # ------------------------------------------------------------ what a subclass gives

    def decay_and_rate(
        self, gates: dict[str, Tensor], like: Tensor
    ) -> tuple[Tensor | None, Tensor | None]:
        """The log decay, (B, H, N) or (B, H, N, Dk) (None: none), and the delta rule's rate
        beta, (B, H, N) (None: no delta rule), of the keys ``like`` (B, H, N, Dk), from the
        kernel's gate inputs."""
        return None, None

    def feature_map(self, x: Tensor) -> Tensor:
        """The map of q and of k (one map, both): the identity here; a subclass returns its
        features of x (B, H, N, qk_dim), e.g. ``F.elu(x) + 1``, ``torch.relu(x)`` or
        ``F.normalize(x, dim=-1)``.

        It runs first, in ``inputs``: forward (our chunked path and fla's op),
        ``weights``, ``reference_weights`` (in float64) and ``decode`` all see feature_map(q)
        and feature_map(k), and padded keys are zeroed after it (they still write nothing
        when the map of 0 is not 0, as elu + 1's). It maps each token on its own (a map of
        a token's channels; one across tokens would read the future and break decoding),
        inside the kernel: after the layer's parts (``qk_activation``, ``qk_norm``) and its
        positions (RoPE).

        It keeps the width: the state (Dk = qk_dim), ``state_size`` and a per-channel gate
        are qk_dim wide, so a map to another width is refused. For features F wide, set
        ``self.qk_dim = F`` in ``__init__``: the layer then projects x straight to q and k F
        wide (as Based does), and the map keeps that width."""
        return x

    def mapped(self, x: Tensor, which: str) -> Tensor:
        """``feature_map(x)`` of q or k (``which``), refused in one line if its shape changed."""
        out = self.feature_map(x)
        if out.shape[-1] != x.shape[-1]:
            width = out.shape[-1]
            raise ValueError(
                f"{self.name}: feature_map must keep the width of {which} (qk_dim = "
                f"{x.shape[-1]}), got {width}; for {width} features set self.qk_dim = {width} "
                f"in __init__ (the layer then projects x to q and k {width} wide) and keep "
                "the map's width"
            )
        if out.shape != x.shape:
            raise ValueError(
                f"{self.name}: feature_map changed the shape of {which} from "
                f"{tuple(x.shape)} to {tuple(out.shape)}; it must map each token on its own, "
                "keeping (B, H, N, qk_dim)"
            )
        return out

    # ------------------------------------------------------------ the contract

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}, backend={self.backend}"

    def inputs(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor | None,
        causal: bool,
        key_padding_mask: Tensor | None,
        gates: dict[str, Tensor],
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, int]:
        """q, k, v, log decay and rate as the recurrence takes them, one query a key: q and k
        mapped (``feature_map``), the queries aligned to the last keys (missing ones zero,
        their outputs dropped), keys before the first query (none: zeros) and padded keys
        writing nothing and decaying nothing. Also how many leading outputs to drop."""
        self.check_call(causal, gates)
        q, k = self.mapped(q, "q"), self.mapped(k, "k")  # before anything else
        log_decay, beta = self.decay_and_rate(gates, k)
        if self.keys_per_token > 1:  # one step a key: the sequence of the keys
            q, log_decay, key_padding_mask = self.steps(q, log_decay, key_padding_mask)
        nq, nk = q.shape[2], k.shape[2]
        if nq > nk:  # queries before the first key: empty keys before them
            front = nq - nk
            k = F.pad(k, (0, 0, front, 0))
            v = None if v is None else F.pad(v, (0, 0, front, 0))
            log_decay = None if log_decay is None else pad_tokens(log_decay, front)
            beta = None if beta is None else F.pad(beta, (front, 0))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (front, 0), value=True)
        skip = max(0, nk - nq)  # keys before the first query: their outputs are dropped
        q = F.pad(q, (0, 0, skip, 0))
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, :]  # (B, 1, N)
            k = k * keep[..., None]
            v = None if v is None else v * keep[..., None]
            if log_decay is not None:
                log_decay = log_decay * (keep if log_decay.dim() == 3 else keep[..., None])
            if beta is not None:
                beta = beta * keep
        return q, k, v, log_decay, beta, skip

    def check_call(self, causal: bool, gates: dict[str, Tensor]) -> None:
        """One line unless the call is causal and brings every gate input the kernel
        declares."""
        if not causal:
            raise ValueError(self.noncausal_refusal())
        missing = [name for name in self.gate_inputs if name not in gates]
        if missing:
            raise ValueError(
                f"{self.name} needs its gate inputs {', '.join(missing)} (B, H, N) or (B, H, N, "
                "D) as keyword arguments: its multi-head layer projects them from x "
                "(nn.multihead.MultiHeadAttention)"
            )

    def check_decode_tokens(self, q: Tensor, k: Tensor) -> None:
        """One line unless q and k hold the same new tokens (``keys_per_token`` keys a
        token)."""
        if q.shape[2] * self.keys_per_token != k.shape[2]:
            raise ValueError(
                f"{self.name}.decode: q and k must hold the same new tokens, got "
                f"{q.shape[2]} queries and {k.shape[2]} keys ({self.keys_per_token} a token)"
            )

    def steps(
        self, q: Tensor, log_decay: Tensor | None, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """For n = ``keys_per_token`` keys a token, the recurrence one step a key: each
        query after its token's last key (zero queries at the n - 1 steps before, whose
        outputs ``read`` drops), a decay a token at its token's first key, and the padding
        mask of each key."""
        n = self.keys_per_token
        b, h, nq, d = q.shape
        q = torch.cat([q.new_zeros(b, h, nq, n - 1, d), q[:, :, :, None]], 3).flatten(2, 3)
        if log_decay is not None:
            rest = log_decay.new_zeros(*log_decay.shape[:3], n - 1, *log_decay.shape[3:])
            log_decay = torch.cat([log_decay[:, :, :, None], rest], 3).flatten(2, 3)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.repeat_interleave(n, 1)
        return q, log_decay, key_padding_mask

    def read(self, out: Tensor, skip: int) -> Tensor:
        """The queries' outputs (rows) of the recurrence's, past the ``skip`` dropped: every
        step's, or, for n keys a token, the step after each token's last key."""
        n = self.keys_per_token
        return out[:, :, skip + n - 1 :: n]

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
        q, k, v, log_decay, beta, skip = self.inputs(q, k, v, causal, key_padding_mask, gates)
        fla = choose(self.backend, self.fused_backends, q.device) == "fla"
        dtype = compute_dtype(v)  # autocast's (bf16-mixed) or the inputs' own
        if (
            fla
            and self.backend == "auto"
            and fla_ops.refuses(dtype, log_decay, beta, self.keys_per_token)
        ):
            fla = False  # fla's delta rule takes no float32: our loop does
        if fla:
            with torch.autocast(q.device.type, enabled=False):
                q, k, v = (t.to(dtype) for t in (q, k, v))
                out = fla_ops.fla_recurrence(
                    q, k, v, log_decay, beta, scale=self.scale, keys_per_token=self.keys_per_token
                )
            return out[:, :, skip // self.keys_per_token :]  # one output a token
        with torch.autocast(q.device.type, enabled=False):
            dtype = v.dtype
            q, k, v, log_decay, beta = at_least_float32(q, k, v, log_decay, beta)
            out, _ = chunked_recurrence(
                q, k, v, log_decay, beta, scale=self.scale, chunk_size=self.chunk_size,
                read_every=self.keys_per_token,
            )  # fmt: skip
        return out[:, :, skip // self.keys_per_token :].to(dtype)  # one output a token

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> Tensor:
        """The (B, H, Nq, Nk) matrix with ``forward == weights @ v``: the decayed scores
        scale (q_t . k_s) exp(b_t - b_s), s <= t, times (I + A)^-1 diag(beta) under the
        delta rule (``gated``'s WY form over the whole sequence)."""
        self.check_inputs(q, k, None, key_padding_mask)
        nk = k.shape[2]
        q, k, _, log_decay, beta, skip = self.inputs(q, k, None, causal, key_padding_mask, gates)
        q, k, log_decay, beta = at_least_float32(q, k, log_decay, beta)  # as forward
        n = k.shape[2]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if log_decay is None:
            scores = (self.scale * q) @ k.mT
        elif log_decay.dim() == 3:
            pair = pair_decay(log_decay.cumsum(-1), lower)  # the scores' and the WY form's
            scores = ((self.scale * q) @ k.mT) * pair
        else:
            cum = log_decay.cumsum(2)
            diff = cum[:, :, :, None] - cum[:, :, None, :]  # (B, H, N, N, Dk)
            decay = diff.masked_fill(~lower[..., None], float("-inf")).exp()
            scores = (self.scale * q[:, :, :, None] * k[:, :, None] * decay).sum(-1)
        scores = scores.masked_fill(~lower, 0.0)
        if beta is not None:
            if log_decay is None:
                kk = k @ k.mT
            elif log_decay.dim() == 3:
                kk = (k @ k.mT) * pair
            else:  # a decay per key channel (KDA): k_t . (k_s exp(b_t - b_s))
                kk = (k[:, :, :, None] * k[:, :, None] * decay).sum(-1)
            a = (beta[..., None] * kk).tril(-1)  # scores (I + A)^-1 diag(beta), by a solve
            scores = (
                torch.linalg.solve_triangular(
                    a, scores, upper=False, left=False, unitriangular=True
                )
                * beta[..., None, :]
            )
        return self.read(scores, skip)[..., n - nk :]

    def reference_weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> Tensor:
        """The weights read from the token-by-token recurrence in float64: fed the one-hot
        value of each key, it outputs each query's weight of each key."""
        self.check_inputs(q, k, None, key_padding_mask)
        q, k = q.double(), k.double()
        gates = {name: g.double() for name, g in gates.items()}
        nk = k.shape[2]
        onehot = torch.eye(nk, dtype=torch.float64).expand(*k.shape[:2], nk, nk)
        q, k, v, log_decay, beta, skip = self.inputs(q, k, onehot, causal, key_padding_mask, gates)
        out, _ = naive_recurrence(q, k, v, log_decay, beta, scale=self.scale)
        return self.read(out, skip)

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
        """T new tokens against the state (B, H, Dk, Dv) of the ones before: the recurrence
        for one token, the chunked path for more; the state's size never grows."""
        self.check_inputs(q, k, v, key_padding_mask)
        self.check_decode_tokens(q, k)
        q, k, v, log_decay, beta, _ = self.inputs(q, k, v, True, key_padding_mask, gates)
        with torch.autocast(q.device.type, enabled=False):
            dtype = v.dtype
            q, k, v, log_decay, beta = at_least_float32(q, k, v, log_decay, beta)
            state = None if state is None else state.to(q.dtype)
            if q.shape[2] <= self.keys_per_token:  # one token
                out, state = naive_recurrence(
                    q, k, v, log_decay, beta, scale=self.scale, state=state
                )
                out = self.read(out, 0)
            else:
                out, state = chunked_recurrence(
                    q, k, v, log_decay, beta, scale=self.scale, state=state,
                    chunk_size=self.chunk_size, read_every=self.keys_per_token,
                )  # fmt: skip
        return out.to(dtype), state

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Any:
        raise ValueError(self.noncausal_refusal())

    def flops(self, n: int, causal: bool = True, value_dim: int | None = None) -> int:
        """The recurrence's work, the same a token whatever n: each key written into the
        state S (Dk x Dv), 2 Dk Dv, and with the delta rule first read from it, 2 Dk Dv
        more; each query read from it, 2 Dk Dv; forward, and twice that backward. The
        decay's elementwise work is not counted, nor the chunked path's in-chunk blocks
        (a form of the same sum)."""
        value_dim = self.head_dim if value_dim is None else value_dim
        state = self.qk_dim * value_dim
        per_key = 2 * state * self.state_products_per_key
        return 3 * (per_key * self.keys_per_token + 2 * state) * n * self.n_head

    @property
    def state_products_per_key(self) -> int:
        """The state-sized products a key costs: its write, and the delta rule's read."""
        return 2 if self.delta_rule else 1

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        """The state S: H Dk Dv numbers, whatever n."""
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.n_head * self.qk_dim * value_dim


class TemperedDecayKernel(GatedKernel):
    """A gated kernel whose one gate input g gives its decay, log alpha = g / tau, g a
    logsigmoid (GLA's form: alpha = sigmoid(W x)^(1/tau)), per head or per key channel as
    the subclass's ``gate_inputs`` declares.

    Args:
        gate_normalizer: tau (16, as fla's GLA layers): a larger tau, a longer memory.
        chunk_size, backend: as for every gated kernel (``GatedKernel``).
    """

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        chunk_size: int = 64,
        gate_normalizer: float = 16.0,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout, chunk_size, backend)
        if not gate_normalizer > 0:
            raise ValueError(f"{self.name}: gate_normalizer must be > 0, got {gate_normalizer!r}")
        self.gate_normalizer = float(gate_normalizer)

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):  # type: ignore[override]
        (gate,) = self.gate_inputs
        return gates[gate] / self.gate_normalizer, None


def mamba_decay_parameters(n_head: int, *channels: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Mamba2's decay, log alpha = -exp(A_log_h) softplus(a + dt_bias), initialised as fla's
    layers do: A_h drawn in [1, 16] a head, dt_bias the inverse softplus of a step drawn
    log-uniformly in [0.001, 0.1], (n_head, *channels) of them (one a head, or one a head
    and key channel)."""
    a_log = nn.Parameter(torch.empty(n_head).uniform_(1, 16).log())
    low, high = math.log(0.001), math.log(0.1)
    dt = torch.exp(torch.rand(n_head, *channels) * (high - low) + low)
    return a_log, nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


def mamba_log_decay(a: Tensor, a_log: Tensor, dt_bias: Tensor, like: Tensor) -> Tensor:
    """-exp(A_log_h) softplus(a + dt_bias) for a gate input a (B, H, N) or (B, H, N, Dk),
    dt_bias (H) or (H, Dk)."""
    bias = dt_bias[:, None] if dt_bias.dim() == 1 else dt_bias[:, None, :]
    scale = a_log.exp().view(-1, *[1] * (a.dim() - 2))
    return -scale.to(like) * F.softplus(a + bias.to(like))


def at_least_float32(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Each tensor in float32 if it is in half precision (``HALF``), as the states
    accumulate; None stays None."""
    return tuple(None if t is None else t.float() if t.dtype in HALF else t for t in tensors)


def pad_tokens(t: Tensor, front: int) -> Tensor:
    """(B, H, N) or (B, H, N, D) with ``front`` zero tokens before the first."""
    return F.pad(t, (front, 0) if t.dim() == 3 else (0, 0, front, 0))
