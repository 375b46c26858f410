"""Linear attention with the elu + 1 feature map (Katharopoulos et al., "Transformers are
RNNs", 2020): the weight of key j for query i is phi(q_i) . phi(k_j), normalised over the
keys, with phi(x) = elu(x) + 1 > 0 elementwise. Linear in the sequence length, with a
recurrent state of constant size for decoding, on the feature-map engine (p = 0)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.feature_map import FeatureKernel


class LinearAttention(FeatureKernel):
    """Linear attention, phi(x) = elu(x) + 1 (Katharopoulos et al., 2020).

    Args:
        chunk_size, impl, compiled, dropout, backend: as for every linear kernel
            (``FeatureKernel``).
    """

    name = "linear"
    formula = "φ(q)·φ(k) normalised over keys, φ = elu + 1"

    def __init__(self, head_dim: int, n_head: int, dropout: float = 0.0, **engine: Any) -> None:
        super().__init__(head_dim, n_head, dropout, p=0, **engine)

    def features(self, x: Tensor, role: str) -> Tensor:
        return F.elu(x) + 1.0

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``phi(q_i) . phi(k_j) / sum_j``, phi(x) = x + 1 for x > 0, else exp(x)."""

        def phi(x: Tensor) -> Tensor:
            x = x.double()
            return torch.where(x > 0, x + 1.0, torch.exp(x))

        f = naive.dot(phi(q), phi(k))
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))
