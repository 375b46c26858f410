"""Retention (Sun et al., "Retentive Network", 2023): linear attention whose state decays
by a fixed gamma per head, gamma_h = 1 - 2^(-5 - h), on the gated recurrence."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from transformers_lab.attention.gated.kernel import GatedKernel


class RetNetAttention(GatedKernel):
    """Retention (RetNet): a fixed decay gamma_h per head.

    S_t = gamma_h S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(D).

    Args:
        chunk_size, backend: as for every gated kernel (``GatedKernel``).
        gamma: the decay of each head, in (0, 1]; one number: the same decay for every
            head; None: RetNet's 1 - 2^(-5 - h).
    """

    name = "retnet"
    formula = "γₕ^(t−s) q·k/√d, γₕ = 1 − 2^(−5−h), causal"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        chunk_size: int = 64,
        gamma: float | Sequence[float] | None = None,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout, chunk_size, backend)
        given = gamma
        if gamma is None:
            gamma = [1 - 2.0 ** (-5 - h) for h in range(n_head)]
        elif isinstance(gamma, (int, float)):
            gamma = [gamma] * n_head
        elif isinstance(gamma, Sequence) and not isinstance(gamma, str):
            gamma = list(gamma)
        if not (
            isinstance(gamma, list) and len(gamma) == n_head and all(_is_decay(g) for g in gamma)
        ):
            raise ValueError(
                f"retnet: gamma must be one decay in (0, 1], or one per head ({n_head}), "
                f"got {given!r}; leave it null for RetNet's 1 - 2^(-5 - h)"
            )
        self.register_buffer(
            "log_gamma", torch.tensor([math.log(g) for g in gamma]), persistent=False
        )

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):  # type: ignore[override]
        b, h, n, _ = like.shape
        return self.log_gamma.to(like)[None, :, None].expand(b, h, n), None


def _is_decay(g: object) -> bool:
    return isinstance(g, (int, float)) and not isinstance(g, bool) and 0 < g <= 1
