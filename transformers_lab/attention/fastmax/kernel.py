"""The fastmax kernel: prepares q, k and [v, 1], picks a path, normalises."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.base import AttentionKernel, Memory, attention_mask
from transformers_lab.attention.fastmax.chunked import chunked_causal
from transformers_lab.attention.fastmax.factorized import factorized
from transformers_lab.attention.fastmax.features import (
    SUPPORTED_P,
    feature_dim,
    read_state,
    weighted_state,
)
from transformers_lab.attention.fastmax.naive import polynomial_matrix, quadratic
from transformers_lab.attention.fastmax.recurrent import recurrent_step


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den, with zeros where den is 0 (a query that saw no key)."""
    return num / den.masked_fill(den == 0, 1.0)


def normalise_output(out_aug: Tensor) -> Tensor:
    """Split [numerator, denominator] and divide; a query that saw no key gives zeros."""
    return safe_divide(out_aug[..., :-1], out_aug[..., -1:])


class FastmaxAttention(AttentionKernel):
    """Fastmax attention of Taylor order ``p``, linear in sequence length.

    Args:
        p: Taylor order, 1 or 2. ``p=2`` is positive for every score. ``p=1`` is positive
            only when ``|s q.k| <= 1``, so it requires ``normalize=True`` and ``scale <= 1``.
        scale: s, multiplies q.k before the polynomial.
        normalize: divide every query and key by its own L2 norm over the head dimension.
            The norm of each token uses that token alone, so nothing leaks from the future.
        chunk_size: C, the tokens processed at once by the linear paths.
        impl: ``"linear"`` (factorized / chunked), ``"quadratic"`` (the reference) or
            ``"auto"``: quadratic while the keys are no more than the feature dimension
            (D + 1 for p=1, about D^2 / 2 for p=2), where the N x N form is the cheaper in
            time and memory (at N=32, D=32 about 35x faster), linear beyond. Both give
            the same result; incremental decoding always uses the recurrent state.
        dropout: drops whole keys. During training each (batch, head, key) is kept with
            probability 1 - dropout and its value scaled by 1 / (1 - dropout); the
            normaliser is unchanged, so, as with dropout on an attention matrix, the
            expected output is unchanged. Dropping single (query, key) weights would need
            the N x N matrix that the linear paths never build.
        eps: guards the norm of an all-zero query or key.

    Under autocast (fp16 / bf16) the states are accumulated in float32.
    """

    name = "fastmax"
    formula = "Σ_{m≤p} (s q·k)^m / m!, normalised over keys"
    linear = True
    IMPLS = ("auto", "linear", "quadratic")

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        p: int = 2,
        scale: float = 1.0,
        normalize: bool = True,
        chunk_size: int = 128,
        impl: str = "auto",
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

    def path(self, num_keys: int) -> str:
        """The implementation ``forward`` takes for ``num_keys`` keys."""
        if self.impl != "auto":
            return self.impl
        return "quadratic" if num_keys <= feature_dim(self.head_dim, self.p) else "linear"

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
            if self.path(k.shape[2]) == "quadratic":
                out = quadratic(qs, ks, v_aug, self.p, causal)
            elif causal:
                out, _ = chunked_causal(qs, ks, v_aug, self.p, self.chunk_size)
            else:
                out = factorized(qs, ks, v_aug, self.p, self.chunk_size)
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
            allowed = attention_mask(
                q.shape[2],
                k.shape[2],
                causal=causal,
                key_padding_mask=key_padding_mask,
                device=q.device,
            )
            a = polynomial_matrix(qs, ks, self.p, allowed)  # (B, H, Nq, Nk)
            return safe_divide(a, a.sum(dim=-1, keepdim=True)).to(q.dtype)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``f(x_ij) / sum_j f(x_ij)`` with ``f(x) = sum_{m<=p} x^m / m!`` and
        ``x = s q·k`` (of unit q and k when normalize), in float64."""
        if self.normalize:
            q, k = naive.unit(q), naive.unit(k)
        x = self.scale * naive.dot(q, k)
        f = sum(x**m / math.factorial(m) for m in range(self.p + 1))
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        """The recurrent state ``sum_j [v_j, 1] phi(k_j)^T``: H (Dv + 1) F, whatever n."""
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.num_heads * (value_dim + 1) * feature_dim(self.head_dim, self.p)

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Memory:
        """The factorised state of every key: reading it costs O(1) in the memory length."""
        self.check_inputs(k[:, :, :1], k, v, key_padding_mask)
        with torch.autocast(k.device.type, enabled=False):
            _, ks, v_aug = self.prepare(k[:, :, :1], k, v, key_padding_mask)
            return Memory(state=weighted_state(v_aug, ks, self.p))

    def read_memory(self, q: Tensor, memory: Memory) -> Tensor:
        if memory.state is None:
            raise ValueError("fastmax.read_memory needs a memory made by fastmax.memory()")
        with torch.autocast(q.device.type, enabled=False):
            qs, _, _ = self.prepare(q, q, None, None)
            return normalise_output(read_state(qs, memory.state, self.p)).to(q.dtype)

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

        The state is ``sum_j [v_j, 1] phi(k_j)^T`` over the keys seen so far, shape
        (B, H, Dv + 1, feature_dim): its size, and the work per new token, do not grow
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
