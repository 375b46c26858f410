"""Based's linear attention (Arora et al., "Simple linear attention language models
balance the recall-throughput tradeoff", 2024): queries and keys are projected to a
small feature dimension d (16 by default) and weighed by the second-order Taylor
polynomial of exp, 1 + x + x²/2 with x = q'·k'/√d, normalised over the keys. That is
fastmax p = 2 without normalisation on the projected q and k, so it runs on fastmax's
paths; its state holds (Dv + 1)(1 + d + d(d+1)/2) numbers a head."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from transformers_lab.attention import naive
from transformers_lab.attention.linear import FeatureKernel


class BasedAttention(FeatureKernel):
    """Based: the Taylor map of exp on a learned per-head projection to ``feature_dim``.

    Args:
        feature_dim: d, the size q and k are projected to (Based uses 16).
        chunk_size, impl, compiled, dropout: as for every linear kernel (``FeatureKernel``).
    """

    name = "based"
    formula = "1 + x + x²/2, x = (W_q q)·(W_k k)/√d, normalised over keys"

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        feature_dim: int = 16,
        chunk_size: int = 128,
        impl: str = "auto",
        compiled: bool = False,
    ) -> None:
        super().__init__(
            head_dim,
            num_heads,
            dropout,
            p=2,
            chunk_size=chunk_size,
            impl=impl,
            compiled=compiled,
        )
        if not (isinstance(feature_dim, int) and feature_dim > 0):
            raise ValueError(f"based: feature_dim must be a positive int, got {feature_dim!r}")
        self.feature_dim = feature_dim
        bound = 1.0 / math.sqrt(head_dim)  # nn.Linear's init
        self.w_q = nn.Parameter(
            torch.empty(num_heads, head_dim, feature_dim).uniform_(-bound, bound)
        )
        self.w_k = nn.Parameter(
            torch.empty(num_heads, head_dim, feature_dim).uniform_(-bound, bound)
        )

    @property
    def feature_count(self) -> int:
        return self.feature_dim

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_dim={self.feature_dim}"

    def feature_flops(self) -> int:
        """The projections of q and k: forward, and backward to the input and the weight."""
        return 2 * 3 * 2 * self.head_dim * self.feature_dim

    def features(self, x: Tensor, role: str) -> Tensor:
        """The per-head projection; queries also divided by √d."""
        w = self.w_q if role == "q" else self.w_k
        u = torch.einsum("bhnd,hdf->bhnf", x, w.to(x.dtype))
        return u / math.sqrt(self.feature_dim) if role == "q" else u

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``1 + x + x²/2`` with ``x = (q W_q)·(k W_k) / √d``, normalised, in float64."""
        qp = torch.einsum("bhnd,hdf->bhnf", q.double(), self.w_q.double())
        kp = torch.einsum("bhnd,hdf->bhnf", k.double(), self.w_k.double())
        x = naive.dot(qp, kp) / math.sqrt(self.feature_dim)
        f = 1.0 + x + x * x / 2.0
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))
