"""Sliding-window attention: exact softmax over the last W keys (Beltagy et al., 2020;
Mistral; Based-360M's window-256 layers).

Query i, at position p_i = i + (Nk - Nq) among the keys (the contract's alignment), sees
key j when ``0 <= p_i - j < W`` with a causal mask, and when ``|p_i - j| < W`` without one.
``forward`` works in blocks of W queries, each against the 2W (3W without a causal mask)
keys around it, so training holds O(N W) scores, never N x N. ``decode`` keeps a ring
buffer of the last W keys and values: its state and its work per token do not grow with
the context.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.backends import check_backend, choose, settle
from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.flex_ops import flex_window
from transformers_lab.attention.flex_ops import refusal as flex_refusal
from transformers_lab.attention.masks import attention_mask, masked_softmax


def window_mask(nq: int, nk: int, window: int, causal: bool, device: Any = None) -> Tensor:
    """(Nq, Nk) bool: the pairs inside the window (queries aligned to the last Nq keys)."""
    p = torch.arange(nq, device=device)[:, None] + (nk - nq)
    d = p - torch.arange(nk, device=device)[None, :]
    return (d >= 0) & (d < window) if causal else d.abs() < window


class SlidingWindowAttention(AttentionKernel):
    """Softmax attention over a window of the W nearest keys, O(N W) in training.

    Args:
        window: W >= 1, the keys a query sees (itself included): the last W with a causal
            mask, those less than W away on either side without one.
        scale: multiplies q.k before the softmax; None means 1/sqrt(head_dim).
        backend: what runs ``forward`` (``attention.backends``): ``auto``
            (FlexAttention on CUDA, our blocks elsewhere), ``loop`` (our blocks) or
            ``flex`` (FlexAttention's block mask of the band: it skips every block outside
            the window; ``flex_ops``), for self-attention; decoding stays on the ring
            buffer. FlexAttention has no dropout: ``auto`` takes our blocks while dropout
            is on, ``flex`` is refused with dropout.
    """

    name = "sliding_window"
    formula = "softmax(q·k/√D) over the last W keys"
    forms_scores = True
    constant_state = True  # decoding keeps W keys, whatever the context
    positional = True  # the window is a distance within one sequence: no cross-attention
    fused_backends = ("flex",)
    labelled = ("window",)

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        window: int = 64,
        scale: float | None = None,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout)
        self.backend = check_backend(self.name, backend, self.fused_backends)
        if self.backend == "flex" and dropout:
            raise ValueError(
                f"sliding_window: attention.backend=flex has no dropout, got dropout={dropout}; "
                "use attention.backend=auto (our blocks while dropout is on) or dropout=0"
            )
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(
                f"attention.window must be a positive integer (the keys a query sees), got "
                f"{window!r}"
            )
        self.window = window
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    def extra_repr(self) -> str:
        backend = "" if self.backend == "auto" else f", backend={self.backend}"
        return f"{super().extra_repr()}, window={self.window}, scale={self.scale:.4g}{backend}"

    # ------------------------------------------------------------ reference and weights

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        allowed = naive.pair_mask(q, k, False, key_padding_mask).clone()
        nq, nk = q.shape[2], k.shape[2]
        for i in range(nq):
            for j in range(nk):
                d = i + (nk - nq) - j
                inside = 0 <= d < self.window if causal else abs(d) < self.window
                if not inside:
                    allowed[:, :, i, j] = False
        scores = self.scale * naive.dot(q, k) + self.reference_bias(nq, nk)
        return naive.softmax_rows(scores, allowed)

    def visible(
        self, nq: int, nk: int, *, causal: bool, key_padding_mask: Tensor | None, device: Any
    ) -> Tensor:
        allowed = window_mask(nq, nk, self.window, causal, device)
        padded = attention_mask(
            nq, nk, causal=False, key_padding_mask=key_padding_mask, device=device
        )
        return allowed if padded is None else allowed & padded

    def weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        nq, nk = q.shape[2], k.shape[2]
        scores = (q @ k.transpose(-2, -1)) * self.scale + self.score_bias(nq, nk, q)
        allowed = self.visible(
            nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
        )
        return masked_softmax(scores, allowed)

    # ------------------------------------------------------------ the blocked path

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Blocks of W queries against the keys around them: O(N W) scores (or
        FlexAttention's band of blocks, ``backend``)."""
        self.check_inputs(q, k, v, key_padding_mask)
        # FlexAttention serves self-attention (training, a prompt); a decoding step, a few
        # queries against the ring buffer, stays on the blocks: no block mask a token
        fits = q.shape[2] == k.shape[2] and not (self.training and self.dropout > 0)
        fused = choose(self.backend, self.fused_backends, q.device) if fits else None
        why = flex_refusal(q.shape[-1], v.shape[-1], q.device)
        if settle(self.name, self.backend, fused, why) == "flex":
            slopes = self.alibi_slopes.to(q.device, q.dtype) if self.alibi else None
            return flex_window(
                q, k, v, self.window, self.scale, causal=causal,
                key_padding_mask=key_padding_mask, slopes=slopes,
            )  # fmt: skip
        b, h, nq, _ = q.shape
        nk, w = k.shape[2], self.window
        if nk <= 2 * w:  # the keys fit in two windows: the whole matrix is no larger
            a = self.weights(q, k, causal=causal, key_padding_mask=key_padding_mask)
            return F.dropout(a, self.dropout, self.training).to(v.dtype) @ v
        valid = torch.ones(b, nk, dtype=torch.bool, device=q.device)
        if key_padding_mask is not None:
            valid = ~key_padding_mask
        if nq > nk:  # queries before the first key: give them empty keys to stand on
            extra = nq - nk
            k, v = F.pad(k, (0, 0, extra, 0)), F.pad(v, (0, 0, extra, 0))
            valid = F.pad(valid, (extra, 0), value=False)
            nk = nq
        off = nk - nq  # query i sits at position i + off: put it there
        length = -(-nk // w) * w
        qp = F.pad(q, (0, 0, off, length - nk))  # (B, H, L, D), L a multiple of W
        right = w if not causal else 0
        kp = F.pad(k, (0, 0, w, length - nk + right))  # W empty keys before (after)
        vp = F.pad(v, (0, 0, w, length - nk + right))
        validp = F.pad(valid, (w, length - nk + right), value=False)
        span = 2 * w + right  # the keys around a block of W queries
        nb = length // w
        kw = kp.unfold(2, span, w)  # (B, H, nb, D, span): block i's keys start at i W - W
        vw = vp.unfold(2, span, w).transpose(-2, -1)  # (B, H, nb, span, Dv)
        ok = validp.unfold(1, span, w)[:, None, :, None, :]  # (B, 1, nb, 1, span)
        qb = qp.view(b, h, nb, w, -1)
        scores = (qb @ kw) * self.scale  # (B, H, nb, W, span)
        d = torch.arange(w, device=q.device)[:, None] + w - torch.arange(span, device=q.device)
        band = (d >= 0) & (d < w) if causal else d.abs() < w  # (W, span): position p - key
        if self.alibi:
            slopes = self.alibi_slopes.to(scores.device, scores.dtype)
            scores = scores - slopes[:, None, None, None] * d.abs().to(scores.dtype)
        a = masked_softmax(scores, band & ok)
        a = F.dropout(a, self.dropout, self.training).to(v.dtype)
        out = (a @ vw).reshape(b, h, length, -1)
        return out[:, :, off : off + nq]

    # ------------------------------------------------------------ decoding

    def pairs(self, n: int, causal: bool) -> int:
        """The pairs inside the window: W or fewer keys a query."""
        w = min(self.window, n)
        before = w * (w + 1) // 2 + (n - w) * w  # the key itself and the W - 1 before it
        return before if causal else 2 * before - n

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        """The ring buffer: W keys and values a head, whatever n."""
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.n_head * self.window * (self.head_dim + value_dim)

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Any = None,
        *,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Any]:
        """T new tokens against a ring buffer of the last W keys and values: the state is
        (keys (B, H, W, D), values (B, H, W, Dv), which slots hold a key (B, W), tokens
        seen)."""
        self.check_inputs(q, k, v, key_padding_mask)
        b, h, t, _ = k.shape
        w = self.window
        if state is None:
            state = (
                k.new_zeros(b, h, w, k.shape[-1]),
                v.new_zeros(b, h, w, v.shape[-1]),
                torch.zeros(b, w, dtype=torch.bool, device=k.device),
                0,
            )
        k_buf, v_buf, filled, seen = state
        shift = -(seen % w)  # oldest slot first
        past_k, past_v = k_buf.roll(shift, 2), v_buf.roll(shift, 2)
        past_ok = filled.roll(shift, 1)
        new_ok = (
            torch.ones(b, t, dtype=torch.bool, device=k.device)
            if key_padding_mask is None
            else ~key_padding_mask
        )
        keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        pad = ~torch.cat([past_ok, new_ok], 1)
        out = self(q, keys, values, causal=True, key_padding_mask=pad)
        kept = min(t, w)  # the last W new tokens go into their slots
        slots = (seen + torch.arange(t - kept, t, device=k.device)) % w
        k_buf = k_buf.index_copy(2, slots, k[:, :, t - kept :])
        v_buf = v_buf.index_copy(2, slots, v[:, :, t - kept :])
        filled = filled.index_copy(1, slots, new_ok[:, t - kept :])
        return out, (k_buf, v_buf, filled, seen + t)
