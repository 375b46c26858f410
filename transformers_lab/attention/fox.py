"""The Forgetting Transformer (FoX; Lin et al., "Forgetting Transformer: Softmax Attention
with a Forget Gate", ICLR 2025): softmax attention whose scores are decayed by a forget
gate f_t = sigmoid(w_f . x_t + b_f), one per head and token:

    o_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(D) + D_ij) v_j,
    D_ij = sum_{l = j+1}^{i} log f_l = c_i - c_j,  c = cumsum(log f)

(fla's ``fla/ops/forgetting_attn/naive.py``). It is quadratic, and causal only.

The bias is of rank two, so it rides in two extra channels of q and k:
[q / sqrt(D), c_i - r, 1] . [k, 1, -(c_j - r)], and SDPA's flash kernel runs the whole
causal call (values padded to the same width; 1.3x softmax's time at N = 4096 on a CPU).
Its rounding is that of numbers |c - r| wide, so it serves a call whose cumulative gate
spans at most ``ONE_CALL_SPAN`` (r its middle). A longer span, or padding, goes by query
blocks (``BLOCK`` queries), each about its own r, the cumulative gate at its last query:
every key a query can see then has c_j - r >= 0, and a key that contributes has it small,
so the block's scores keep softmax's precision.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention import fla_ops, naive
from transformers_lab.attention.backends import check_backend, choose
from transformers_lab.attention.base import AttentionKernel, GateInput, extend_cache
from transformers_lab.attention.masks import attention_mask, masked_softmax

ONE_CALL_SPAN = 64.0  # the cumulative log gate one SDPA call takes: errors of ~1e-5 at most
BLOCK = 128  # the queries of a block otherwise: a span of ~25 a block at log f = -0.2


class ForgettingAttention(AttentionKernel):
    """FoX: softmax attention with a forget gate per head and token, from x.

    The gate input ``f``, log f = logsigmoid(w_f . x + b_f), is projected from x by the
    layer.

    Decoding keeps the KV cache and each cached key's cumulative log gate, taken about
    the last token (so the running sum never grows). A padded key is not seen and
    forgets nothing.

    Args:
        scale: multiplies q . k (None: 1 / sqrt(head_dim)).
        backend: ``auto`` (fla's ``parallel_forgetting_attn`` on CUDA where installed, our
            path elsewhere), ``loop`` (our path) or ``fla``. fla's op serves the unpadded
            causal self-attention of a training step, without dropout; every other call
            runs our path.
    """

    name = "fox"
    formula = "softmax(q·k/√D + Σ_{j<l≤i} log f_l), f = σ(w·x), causal"
    causal_only = True
    forms_scores = True  # ALiBi: a constant forget gate, e^-slope a token, beside f
    fused_backends = ("fla",)
    gate_inputs: ClassVar[dict[str, GateInput]] = {"f": GateInput("logsigmoid")}

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        scale: float | None = None,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout)
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.backend = check_backend(self.name, backend, self.fused_backends)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}, backend={self.backend}"

    # ------------------------------------------------------------ the gate

    def log_gates(
        self, gates: dict[str, Tensor], nk: int, pad: Tensor | None, alibi: bool = True
    ) -> Tensor:
        """log f (B, H, Nk), <= 0, zero at padded keys (they forget nothing); with ALiBi
        (``pos_encoding=alibi``) minus each head's slope at every token, padded or not: its
        bias, -slope (i - j), is the sum of those between key and query."""
        if "f" not in gates:
            raise ValueError(
                "fox needs its gate input f (B, H, N) as a keyword argument: its multi-head "
                "layer projects it from x (nn.multihead.MultiHeadAttention)"
            )
        log_f = gates["f"]
        if log_f.shape[-1] != nk or log_f.dim() != 3:
            raise ValueError(f"fox: the gate f must be (B, H, Nk={nk}), got {tuple(log_f.shape)}")
        if not bool(((log_f <= 0) & log_f.isfinite()).all()):
            raise ValueError(
                "fox: the log forget gate must be finite and <= 0 (a gate in (0, 1]): pass "
                "F.logsigmoid(x), not the gate itself"
            )
        if pad is not None:
            log_f = log_f.masked_fill(pad[:, None, :], 0.0)
        if alibi and self.alibi:
            log_f = log_f - self.alibi_slopes.to(log_f)[:, None]
        return log_f

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
        if not causal:
            raise ValueError(self.noncausal_refusal())
        log_f = self.log_gates(gates, k.shape[2], key_padding_mask)
        fused = choose(self.backend, self.fused_backends, q.device) == "fla"
        dropout = self.dropout if self.training else 0.0
        if fused and key_padding_mask is None and q.shape[2] == k.shape[2] and not dropout:
            return fla_ops.fla_forgetting(q, k, v, log_f, scale=self.scale)
        return self.attend(q, k, v, cumulative(log_f, q.dtype), key_padding_mask)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, c: Tensor, pad: Tensor | None) -> Tensor:
        """Causal attention of q, aligned to the last keys, with the bias c_i - c_j from the
        cumulative log gates ``c`` (B, H, Nk) of the keys (the module doc's two forms)."""
        dtype = v.dtype
        nq, nk = q.shape[2], k.shape[2]
        if nq > nk:  # queries before the first key see nothing
            out = self.attend(q[:, :, nq - nk :], k, v, c, pad)
            return F.pad(out, (0, 0, nq - nk, 0))
        with torch.autocast(q.device.type, enabled=False):
            work = torch.promote_types(dtype, torch.float32)  # c's rounding: not in half
            q, k, v, c = q.to(work), k.to(work), v.to(work), c.to(work)
            dropout = self.dropout if self.training else 0.0
            span = (c[..., 0] - c[..., -1]).detach()  # c decreases
            if pad is None and nq == nk and bool((span <= ONE_CALL_SPAN).all()):
                r = (c[..., :1] + c[..., -1:]).detach() / 2
                out = self._one_call(q, k, v, c - r, c - r, None, dropout)
            else:
                out = torch.cat(
                    [
                        self._block(q, k, v, c, pad, start, min(nq, start + BLOCK), dropout)
                        for start in range(0, nq, BLOCK)
                    ],
                    dim=2,
                )
        return out.to(dtype)

    def _one_call(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cq: Tensor,
        ck: Tensor,
        mask: Tensor | None,
        dropout: float,
    ) -> Tensor:
        """SDPA on [s q, cq, 1] . [k, 1, -ck], values padded by two zero channels; causal
        (top-left, Nq == Nk) where ``mask`` is None."""
        one_q, one_k = cq.new_ones(*cq.shape, 1), ck.new_ones(*ck.shape, 1)
        qa = torch.cat([q * self.scale, cq[..., None], one_q], -1)
        ka = torch.cat([k, one_k, -ck[..., None]], -1)
        va = F.pad(v, (0, 2))  # one width for q, k and v: SDPA's fast kernels
        out = F.scaled_dot_product_attention(
            qa, ka, va, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=1.0
        )
        return out[..., : v.shape[-1]]

    def _block(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        c: Tensor,
        pad: Tensor | None,
        start: int,
        end: int,
        dropout: float,
    ) -> Tensor:
        """Queries [start, end) (aligned to the last keys) over the keys they can see, about
        r = c at the block's last query; a query that sees no key gives zeros."""
        nq, nk = q.shape[2], k.shape[2]
        offset = nk - nq
        last = offset + end  # keys [0, last) are seen by some query of the block
        r = c[..., last - 1 : last].detach()
        cq = c[..., offset + start : last] - r
        ck = c[..., :last] - r
        allowed = attention_mask(
            end - start,
            last,
            causal=True,
            key_padding_mask=None if pad is None else pad[:, :last],
            device=q.device,
        )
        has_key = allowed.any(-1, keepdim=True)
        out = self._one_call(
            q[:, :, start:end], k[:, :, :last], v[:, :, :last], cq, ck, allowed | ~has_key, dropout
        )
        return out.masked_fill(~has_key, 0.0)

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> Tensor:
        """softmax(s q . k + c_i - c_j) over the keys a query sees, explicitly."""
        self.check_inputs(q, k, None, key_padding_mask)
        if not causal:
            raise ValueError(self.noncausal_refusal())
        nq, nk = q.shape[2], k.shape[2]
        log_f = self.log_gates(gates, nk, key_padding_mask)
        c = cumulative(log_f, q.dtype)
        cq = F.pad(c, (max(nq - nk, 0), 0))[..., -nq:]  # queries aligned to the last keys
        scores = self.scale * (q @ k.mT) + (cq[..., :, None] - c[..., None, :])
        allowed = attention_mask(
            nq, nk, causal=True, key_padding_mask=key_padding_mask, device=q.device
        )
        return masked_softmax(scores, allowed).to(q.dtype)

    def reference_weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> Tensor:
        """The weights in float64, D_ij summed term by term: sum of log f_l over
        j < l <= i (query i at key position i + Nk - Nq)."""
        q, k = q.double(), k.double()
        nq, nk = q.shape[2], k.shape[2]
        gates = {n: g.double() for n, g in gates.items()}
        log_f = self.log_gates(gates, nk, key_padding_mask, alibi=False)
        i = torch.arange(nq)[:, None, None] + (nk - nq)
        j = torch.arange(nk)[None, :, None]
        l_ = torch.arange(nk)[None, None, :]
        between = ((l_ > j) & (l_ <= i)).double()  # (Nq, Nk, Nk)
        bias = torch.einsum("ijl,bhl->bhij", between, log_f)
        scores = self.scale * naive.dot(q, k) + bias + self.reference_bias(nq, nk)
        return naive.softmax_rows(scores, naive.pair_mask(q, k, True, key_padding_mask))

    def decode(  # type: ignore[override]
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Any = None,
        *,
        key_padding_mask: Tensor | None = None,
        **gates: Tensor,
    ) -> tuple[Tensor, Any]:
        """T new tokens over the cache: (keys, values, padding, c) with c (B, H, N) each
        cached key's cumulative log gate, taken about the last token (0 there)."""
        self.check_inputs(q, k, v, key_padding_mask)
        log_f = self.log_gates(gates, k.shape[2], key_padding_mask)
        c_new = cumulative(log_f, q.dtype)  # after the last cached token, whose c is 0
        if state is not None:
            c_new = torch.cat([state[3], c_new], -1)
        k, v, key_padding_mask = extend_cache(
            None if state is None else state[:3], k, v, key_padding_mask
        )
        out = self.attend(q, k, v, c_new, key_padding_mask)
        return out, (k, v, key_padding_mask, c_new - c_new[..., -1:])

    def noncausal_refusal(self) -> str | None:
        return (
            "attention=fox decays each score by the forget gates between query and key, so "
            "it is causal only: use it in a GPT, or choose another kernel for an encoder or "
            "a cross-attention"
        )

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Any:
        raise ValueError(self.noncausal_refusal())

    @property
    def trimmable(self) -> bool:
        return True

    def trim_state(self, state: Any, keep: int) -> Any:
        """The cache's last ``keep`` tokens, their gate sums with them."""
        if state is None:
            return state
        k, v, pad = super().trim_state(state[:3], keep)  # the default cache's cut
        return k, v, pad, state[3][..., state[3].shape[-1] - k.shape[2] :]

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        """The cache: a key, a value and a gate sum a head and token."""
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.n_head * n * (self.qk_dim + value_dim + 1)


def cumulative(log_f: Tensor, dtype: torch.dtype) -> Tensor:
    """c = cumsum(log f) over the keys, in float32 at least (its sums are long)."""
    return log_f.to(torch.promote_types(dtype, torch.float32)).cumsum(-1)
