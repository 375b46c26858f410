"""cosFormer (Qin et al., "cosFormer: Rethinking Softmax in Attention", 2022): ReLU
features re-weighted by the cosine of the distance, in linear time. The weight of key j
for query i is

    relu(q_i) · relu(k_j) cos(π/2 · (i - j) / M),    normalised over the keys,

and cos(a - b) = cos a cos b + sin a sin b splits it into the features
[relu(x) cos(π i / 2M), relu(x) sin(π i / 2M)] of each token, so it runs on fastmax's
engine (p = 0) with twice the head dim. M is fixed (``max_len``), not the length of each
call, so that a causal forward and token-by-token decoding weigh alike; positions past M
are refused. Nearby tokens weigh more (the locality bias of the paper).

The features are relu(x) + ``FEATURE_FLOOR``, not relu(x) alone: where relu(q_i) and
relu(k_j) share no positive coordinate for every key j a query sees (the first causal
query has one key), every product is 0 and the row would be all zero, not a distribution.
The floor gives every visible key a weight of at least D·floor² cos(·) > 0 (|i - j| < M),
too small to change the weights of features of ordinary size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.feature_map import FeatureKernel

# added to relu(x), so that every key a query sees has a positive weight (module docstring)
FEATURE_FLOOR = 1e-6


class CosFormerAttention(FeatureKernel):
    """cosFormer attention: ReLU features with the cos re-weighting, linear time.

    Args:
        max_len: M, the longest sequence (positions 0 .. M - 1); distances are measured
            in quarter turns of M.
        chunk_size, impl, compiled, dropout, backend: as for every linear kernel
            (``FeatureKernel``).
    """

    name = "cosformer"
    formula = "(relu(q)+ε)·(relu(k)+ε) cos(π(i−j)/2M), normalised over keys, ε = 10⁻⁶"
    positional = True

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        max_len: int = 1024,
        **engine: Any,
    ) -> None:
        super().__init__(head_dim, n_head, dropout, p=0, **engine)
        if not (isinstance(max_len, int) and max_len > 0):
            raise ValueError(f"cosformer: max_len must be a positive int, got {max_len!r}")
        self.max_len = max_len

    @property
    def feature_count(self) -> int:
        return 2 * self.head_dim

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_len={self.max_len}"

    def features(self, x: Tensor, role: str) -> Tensor:
        return torch.relu(x) + FEATURE_FLOOR

    def angles(self, start: int, n: int, device: torch.device) -> Tensor:
        if start + n > self.max_len:
            raise ValueError(
                f"cosformer: position {start + n - 1} is past max_len={self.max_len}; "
                "build it with attention.max_len at least the longest sequence"
            )
        position = torch.arange(start, start + n, device=device, dtype=torch.float64)
        return position * (math.pi / (2 * self.max_len))

    def place(self, u: Tensor, start: int) -> Tensor:
        angle = self.angles(start, u.shape[2], u.device)[:, None].to(u.dtype)
        return torch.cat([u * angle.cos(), u * angle.sin()], dim=-1)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``(relu(q_i) + ε)·(relu(k_j) + ε) cos(π/2 (i - j) / M)`` normalised (ε the
        ``FEATURE_FLOOR``), with the queries at the last positions of the keys when causal,
        in float64."""
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, dtype=torch.float64)[:, None] + (nk - nq if causal else 0)
        j = torch.arange(nk, dtype=torch.float64)[None, :]
        f = naive.dot(
            torch.relu(q.double()) + FEATURE_FLOOR, torch.relu(k.double()) + FEATURE_FLOOR
        )
        f = f * torch.cos(math.pi / 2 * (i - j) / self.max_len)
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))
