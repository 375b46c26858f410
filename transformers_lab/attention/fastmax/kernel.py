"""The fastmax kernel: its features (each token by its own norm, queries scaled) and its
reference; the paths are those of every linear kernel (``feature_kernel``)."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.fastmax.feature_kernel import FeatureKernel
from transformers_lab.attention.fastmax.features import SUPPORTED_P


class FastmaxAttention(FeatureKernel):
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
        super().__init__(head_dim, num_heads, dropout, p=p, chunk_size=chunk_size, impl=impl)
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
        self.scale = float(scale)
        self.normalize = normalize
        self.eps = eps

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, p={self.p}, scale={self.scale}, normalize={self.normalize}"

    def features(self, x: Tensor, role: str) -> Tensor:
        """Each token divided by its own L2 norm (when normalize); queries times s."""
        if self.normalize:
            x = F.normalize(x, dim=-1, eps=self.eps)
        return x * self.scale if role == "q" else x

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
