"""Based's linear attention (Arora et al., "Simple linear attention language models
balance the recall-throughput tradeoff", 2024): queries and keys of a small feature
dimension d (16 by default), weighed by the second-order Taylor polynomial of exp,
1 + x + x²/2 with x = q·k/√d, normalised over the keys. That is fastmax p = 2 without
normalisation, so it runs on fastmax's paths; its state holds (Dv + 1)(1 + d + d(d+1)/2)
numbers a head.

As in Zoology's Based (``proj_q``, ``proj_k``: d_model -> d a head), the layer projects x
straight to the d-wide queries and keys: the kernel declares ``qk_dim = feature_dim``, and
the values stay ``head_dim`` wide."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.feature_map import FeatureKernel


class BasedAttention(FeatureKernel):
    """Based: the Taylor map of exp on queries and keys of width ``feature_dim``.

    Args:
        feature_dim: d, the width of q and k a head (Based uses 16); the layer projects
            x to it (``qk_dim``).
        chunk_size, impl, compiled, dropout, backend: as for every linear kernel
            (``FeatureKernel``).
    """

    name = "based"
    fused_backends = ("fla", "flex")
    formula = "1 + x + x²/2, x = q·k/√d, q and k d = feature_dim wide, normalised over keys"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        feature_dim: int = 16,
        **engine: Any,
    ) -> None:
        super().__init__(head_dim, n_head, dropout, p=2, **engine)
        if isinstance(feature_dim, bool) or not (isinstance(feature_dim, int) and feature_dim > 0):
            raise ValueError(f"based: feature_dim must be a positive int, got {feature_dim!r}")
        self.feature_dim = feature_dim
        self.qk_dim = feature_dim

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_dim={self.feature_dim}"

    def features(self, x: Tensor, role: str) -> Tensor:
        """Queries divided by √d; keys as they are."""
        return x / math.sqrt(self.feature_dim) if role == "q" else x

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``1 + x + x²/2`` with ``x = q·k / √d``, normalised, in float64."""
        x = naive.dot(q.double(), k.double()) / math.sqrt(self.feature_dim)
        f = 1.0 + x + x * x / 2.0
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))
