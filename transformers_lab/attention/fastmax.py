"""Fastmax: factorizable polynomial attention (Gerami et al., "FAST: Factorizable Attention
for Speeding up Transformers", arXiv 2402.07901, 2024).

The softmax's exponential is replaced by its Taylor polynomial of order p (1 or 2)::

    a_ij = f(x_ij) / sum_j f(x_ij),   x_ij = s * q_i . k_j,   f(x) = sum_{m<=p} x^m / m!

f(q.k) factorises into ``phi(q) . phi(k)`` with the feature map::

    phi(u) = [1, u, (u_a u_b for a < b), (u_a^2 / sqrt 2 for a)]     # 1 + D + D(D+1)/2 features

(the second-order part is the symmetric half of u (x) u). So the numerator
``sum_j f(x_ij) v_j = phi(q_i) @ sum_j phi(k_j) v_j^T`` costs O(N * D^p * Dv), not O(N^2).

Every path works on ``v_aug = [v, 1]`` with masked keys zeroed: its last column carries
the denominator, so one product gives numerator and normaliser together. The four paths,
which agree to rounding:

- ``quadratic``: the N x N polynomial, the reference (and what ``weights`` returns);
- ``factorized``: non-causal, one state ``sum_j phi(k_j) v_aug_j^T``;
- ``chunked_causal``: the exact polynomial of the C x C scores inside each chunk, and a
  running prefix state across chunks (never an N x D^p x Dv tensor);
- ``recurrent_step``: one new token, state in and state out, O(1) work per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.base import AttentionKernel, attention_mask

SUPPORTED_P = (1, 2)


def poly(x: Tensor, p: int) -> Tensor:
    """The Taylor polynomial of exp of order p: 1 + x (+ x^2 / 2)."""
    return 1.0 + x if p == 1 else 1.0 + x + 0.5 * x * x


def feature_dim(head_dim: int, p: int) -> int:
    """Number of features of ``feature_map`` for head size D: 1 + D (+ D(D+1)/2)."""
    return 1 + head_dim + (head_dim * (head_dim + 1) // 2 if p == 2 else 0)


def feature_map(u: Tensor, p: int) -> Tensor:
    """phi(u), (..., D) -> (..., feature_dim(D, p)), with phi(a) . phi(b) = poly(a . b, p)."""
    ones = u.new_ones(*u.shape[:-1], 1)
    if p == 1:
        return torch.cat([ones, u], dim=-1)
    d = u.shape[-1]
    i, j = torch.triu_indices(d, d, device=u.device)
    # (a.b)^2 / 2 = sum_a a_a^2 b_a^2 / 2 + sum_{a<b} (a_a a_b)(b_a b_b)
    weight = u.new_ones(i.shape[0]).masked_fill(i == j, math.sqrt(0.5))
    return torch.cat([ones, u, u[..., i] * u[..., j] * weight], dim=-1)


def quadratic(q: Tensor, k: Tensor, v_aug: Tensor, p: int, causal: bool) -> Tensor:
    """Reference path: the explicit (B, H, Nq, Nk) polynomial times v_aug."""
    a = poly(q @ k.transpose(-2, -1), p)  # (B, H, Nq, Nk)
    if causal:
        allowed = attention_mask(
            q.shape[2], k.shape[2], causal=True, key_padding_mask=None, device=q.device
        )
        a = a.masked_fill(~allowed, 0.0)
    return a @ v_aug  # (B, H, Nq, Dv + 1)


def factorized(q: Tensor, k: Tensor, v_aug: Tensor, p: int) -> Tensor:
    """Non-causal linear path: phi(q) @ (phi(k)^T @ v_aug)."""
    state = feature_map(k, p).transpose(-2, -1) @ v_aug  # (B, H, F, Dv + 1)
    return feature_map(q, p) @ state  # (B, H, Nq, Dv + 1)


def chunked_causal(
    q: Tensor,
    k: Tensor,
    v_aug: Tensor,
    p: int,
    chunk_size: int,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal linear path. Returns the output and the state after the last key.

    ``state`` (B, H, F, Dv + 1) is the sum of phi(k) v_aug^T over keys seen before ``k``.
    Queries are aligned to the last Nq keys, as in the kernel contract.
    """
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    if state is None:
        state = q.new_zeros(b, h, feature_dim(q.shape[-1], p), v_aug.shape[-1])
    if nk > nq:  # keys before the first query are visible to every query
        split = nk - nq
        state = state + feature_map(k[:, :, :split], p).transpose(-2, -1) @ v_aug[:, :, :split]
        k, v_aug = k[:, :, split:], v_aug[:, :, split:]
    elif nq > nk:  # queries before the first key see nothing: prepend empty keys
        k = F.pad(k, (0, 0, nq - nk, 0))
        v_aug = F.pad(v_aug, (0, 0, nq - nk, 0))
    c = min(chunk_size, nq)
    pad = -nq % c  # empty trailing keys and discarded trailing queries
    if pad:
        q, k, v_aug = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v_aug))
    nc = (nq + pad) // c
    qc = q.reshape(b, h, nc, c, -1)  # (B, H, nc, C, D)
    kc = k.reshape(b, h, nc, c, -1)
    vc = v_aug.reshape(b, h, nc, c, -1)  # (B, H, nc, C, Dv + 1)

    # Inside a chunk: the exact polynomial of the C x C scores, causally masked.
    tril = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    intra = poly(qc @ kc.transpose(-2, -1), p).masked_fill(~tril, 0.0) @ vc

    # Across chunks: chunk n sees the state of every chunk before it.
    chunk_states = feature_map(kc, p).transpose(-2, -1) @ vc  # (B, H, nc, F, Dv + 1)
    running = torch.cumsum(chunk_states, dim=2)
    before = torch.cat([torch.zeros_like(running[:, :, :1]), running[:, :, :-1]], dim=2)
    inter = feature_map(qc, p) @ (before + state.unsqueeze(2))  # (B, H, nc, C, Dv + 1)

    out = (intra + inter).reshape(b, h, nc * c, -1)[:, :, :nq]
    return out, state + running[:, :, -1]


def recurrent_step(
    q: Tensor, k: Tensor, v_aug: Tensor, p: int, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One decoding step: q, k (B, H, 1, D) and v_aug (B, H, 1, Dv + 1) of the new token."""
    update = feature_map(k, p).transpose(-2, -1) @ v_aug  # (B, H, F, Dv + 1)
    state = update if state is None else state + update
    return feature_map(q, p) @ state, state


def normalise_output(out_aug: Tensor) -> Tensor:
    """Split [numerator, denominator] and divide; a query that saw no key gives zeros."""
    num, den = out_aug[..., :-1], out_aug[..., -1:]
    return num / den.masked_fill(den == 0, 1.0)


class FastmaxAttention(AttentionKernel):
    """Fastmax attention of Taylor order ``p``, linear in sequence length.

    Args:
        p: Taylor order, 1 or 2. ``p=2`` is positive for every score. ``p=1`` is positive
            only when ``|s q.k| <= 1``, so it requires ``normalize=True`` and ``scale <= 1``.
        scale: s, multiplies q.k before the polynomial.
        normalize: divide every query and key by its own L2 norm over the head dimension.
            The norm of each token uses that token alone, so nothing leaks from the future.
        chunk_size: C of the causal chunked path.
        impl: ``"linear"`` (factorized / chunked) or ``"quadratic"`` (the reference).
        dropout: drops whole keys. During training each (batch, head, key) is kept with
            probability 1 - dropout and its value scaled by 1 / (1 - dropout); the
            normaliser is unchanged, so, as with dropout on an attention matrix, the
            expected output is unchanged. Dropping single (query, key) weights would need
            the N x N matrix that the linear paths never build.
        eps: guards the norm of an all-zero query or key.

    Under autocast (fp16 / bf16) the states are accumulated in float32.
    """

    name = "fastmax"
    IMPLS = ("linear", "quadratic")

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        p: int = 2,
        scale: float = 1.0,
        normalize: bool = True,
        chunk_size: int = 64,
        impl: str = "linear",
        eps: float = 1e-6,
    ) -> None:
        super().__init__(head_dim, num_heads, dropout)
        if p not in SUPPORTED_P:
            raise ValueError(
                f"fastmax: unsupported Taylor order p={p!r}; supported orders are {SUPPORTED_P}"
            )
        if p == 1 and (not normalize or scale > 1.0):
            raise ValueError(
                "fastmax p=1 gives negative attention weights when |scale * q.k| > 1: "
                f"got normalize={normalize}, scale={scale}. Set normalize=true and scale <= 1, "
                "or use p=2, which is positive for every score."
            )
        if scale <= 0:
            raise ValueError(f"fastmax: scale must be positive, got {scale}")
        if chunk_size < 1:
            raise ValueError(f"fastmax: chunk_size must be >= 1, got {chunk_size}")
        if impl not in self.IMPLS:
            raise ValueError(f"fastmax: unknown impl {impl!r}; choose one of {self.IMPLS}")
        self.p = p
        self.scale = float(scale)
        self.normalize = normalize
        self.chunk_size = chunk_size
        self.impl = impl
        self.eps = eps

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, p={self.p}, scale={self.scale}, normalize={self.normalize}, "
            f"chunk_size={self.chunk_size}, impl={self.impl}"
        )

    def prepare(
        self, q: Tensor, k: Tensor, v: Tensor | None, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Normalised, scaled q and k, and v_aug = [v, 1] with dropped and padded keys zeroed.

        Low-precision inputs are promoted to float32, where the states accumulate.
        """
        if q.dtype in (torch.float16, torch.bfloat16):
            q, k = q.float(), k.float()
            v = None if v is None else v.float()
        if self.normalize:
            q = F.normalize(q, dim=-1, eps=self.eps)
            k = F.normalize(k, dim=-1, eps=self.eps)
        q = q * self.scale
        pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
        if pad is not None:
            k = k.masked_fill(pad, 0.0)
        if v is None:
            return q, k, None
        if self.training and self.dropout > 0:
            keep = torch.rand(*v.shape[:3], 1, device=v.device) >= self.dropout
            v = v * keep.to(v.dtype) / (1.0 - self.dropout)
        v_aug = torch.cat([v, v.new_ones(*v.shape[:3], 1)], dim=-1)  # (B, H, Nk, Dv + 1)
        if pad is not None:
            v_aug = v_aug.masked_fill(pad, 0.0)
        return q, k, v_aug

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, v, key_padding_mask)
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, v_aug = self.prepare(q, k, v, key_padding_mask)
            if self.impl == "quadratic":
                out = quadratic(qs, ks, v_aug, self.p, causal)
            elif causal:
                out, _ = chunked_causal(qs, ks, v_aug, self.p, self.chunk_size)
            else:
                out = factorized(qs, ks, v_aug, self.p)
            return normalise_output(out).to(v.dtype)

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, _ = self.prepare(q, k, None, None)
            a = poly(qs @ ks.transpose(-2, -1), self.p)  # (B, H, Nq, Nk)
            allowed = attention_mask(
                q.shape[2],
                k.shape[2],
                causal=causal,
                key_padding_mask=key_padding_mask,
                device=q.device,
            )
            if allowed is not None:
                a = a.masked_fill(~allowed, 0.0)
            den = a.sum(dim=-1, keepdim=True)
            return (a / den.masked_fill(den == 0, 1.0)).to(q.dtype)

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Causal attention of T new tokens given the recurrent state of the past ones.

        The state is ``sum_j phi(k_j) [v_j, 1]^T`` over the keys seen so far, shape
        (B, H, feature_dim, Dv + 1): its size, and the work per new token, do not grow
        with the context.
        """
        self.check_inputs(q, k, v, key_padding_mask)
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"fastmax.decode: q and k must hold the same new tokens, got {q.shape[2]} "
                f"queries and {k.shape[2]} keys"
            )
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, v_aug = self.prepare(q, k, v, key_padding_mask)
            if q.shape[2] == 1:
                out, state = recurrent_step(qs, ks, v_aug, self.p, state)
            else:
                out, state = chunked_causal(qs, ks, v_aug, self.p, self.chunk_size, state)
            return normalise_output(out).to(v.dtype), state
