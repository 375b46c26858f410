"""Performer's FAVOR+ (Choromanski et al., "Rethinking Attention with Performers", 2021):
positive orthogonal random features whose dot product is an unbiased estimate of the
softmax kernel exp(q·k/√D). With x = u / D^(1/4) and m random directions w_r,

    phi(u) = exp(w_r·x - |x|²/2)_r / √m,    E[phi(q)·phi(k)] = exp(q·k/√D),

and the weights are phi(q_i)·phi(k_j) normalised over the keys, in linear time on
the feature-map engine (p = 0). The directions are orthogonal in blocks of D, each row scaled
to the norm of a Gaussian vector (so that each is marginally N(0, I)), drawn per head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.feature_map import FeatureKernel


def orthogonal_gaussian(
    heads: int, rows: int, dim: int, generator: torch.Generator | None
) -> Tensor:
    """(heads, rows, dim): for each head, blocks of ``dim`` orthonormal rows (QR of a
    Gaussian matrix, signs fixed by R's diagonal so that the block is uniformly random:
    without that, LAPACK's sign convention biases the estimate), each row scaled to the
    norm of an independent Gaussian vector."""
    blocks = []
    for _ in range(heads):
        parts = []
        for _ in range(math.ceil(rows / dim)):
            gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
            q, r = torch.linalg.qr(gaussian)
            parts.append((q * torch.sign(torch.diagonal(r))).T)  # uniform (Haar) rotations
        block = torch.cat(parts)[:rows]
        norms = torch.randn(rows, dim, generator=generator, dtype=torch.float64).norm(dim=-1)
        blocks.append(block * norms[:, None])
    return torch.stack(blocks).float()


class PerformerAttention(FeatureKernel):
    """FAVOR+ attention with positive orthogonal random features.

    Args:
        num_features: m, the random features per head.
        redraw: draw new directions at every training forward (the Performer paper's
            feature redrawing); evaluation uses the last ones drawn.
        seed: draw the directions from a generator of this seed; None draws them from
            torch's global generator (deterministic under the run's ``seed``, and
            different in every layer).
        chunk_size, impl, compiled, dropout, backend: as for every linear kernel
            (``FeatureKernel``).
    """

    name = "performer"
    formula = "φ(q)·φ(k) normalised over keys, φ(u) = exp(ω·x − |x|²/2)/√m, x = u/D^¼"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        num_features: int = 64,
        redraw: bool = False,
        seed: int | None = None,
        **engine: Any,
    ) -> None:
        super().__init__(head_dim, n_head, dropout, p=0, **engine)
        if not (isinstance(num_features, int) and num_features > 0):
            raise ValueError(
                f"performer: num_features must be a positive int, got {num_features!r}"
            )
        self.num_features = num_features
        self.redraw = redraw
        self.seed = seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.register_buffer("omega", self.draw())  # (H, m, D), saved with the model

    def draw(self) -> Tensor:
        return orthogonal_gaussian(self.n_head, self.num_features, self.head_dim, self.generator)

    @property
    def feature_count(self) -> int:
        return self.num_features

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, num_features={self.num_features}, "
            f"redraw={self.redraw}, seed={self.seed}"
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
        if self.training and self.redraw:
            self.omega.copy_(self.draw())
        return super().forward(q, k, v, **kwargs)

    def feature_flops(self) -> int:
        """The random projections of q and k, forward and backward (ω is fixed)."""
        return 2 * 2 * 2 * self.head_dim * self.num_features

    def features(self, x: Tensor, role: str) -> Tensor:
        """exp(ω·x - |x|²/2) / √m of x = u / D^(1/4). A query's features are divided by
        their largest, which cancels in its normalisation and keeps exp in range. A key's
        cannot overflow whatever its norm: ω·x - |x|²/2 <= |ω|²/2 (about D/2 for
        Gaussian rows), and the engine sums them in float32 at least; keys of a very large
        norm underflow to zero weight rather than overflow."""
        x = x / self.head_dim**0.25
        a = torch.einsum("bhnd,hmd->bhnm", x, self.omega.to(x.dtype))
        a = a - x.square().sum(-1, keepdim=True) / 2
        if role == "q":
            a = a - a.amax(-1, keepdim=True).detach()
        return torch.exp(a) / math.sqrt(self.num_features)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``phi(q_i)·phi(k_j) / sum_j`` with the kernel's directions, in float64."""
        omega = self.omega.double()

        def phi(u: Tensor) -> Tensor:
            x = u.double() / self.head_dim**0.25
            a = torch.einsum("bhnd,hmd->bhnm", x, omega) - (x * x).sum(-1, keepdim=True) / 2
            return torch.exp(a) / math.sqrt(self.num_features)

        f = naive.dot(phi(q), phi(k))
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))
