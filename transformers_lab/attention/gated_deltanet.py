"""Gated DeltaNet (Yang et al., "Gated Delta Networks", 2025): the delta rule with a
scalar decay, S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, the decay
in Mamba2's form, log alpha_t = -exp(A_log) softplus(a . x_t + dt_bias), on the gated
recurrence."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.gated.kernel import (
    GatedKernel,
    mamba_decay_parameters,
    mamba_log_decay,
)


class GatedDeltaNetAttention(GatedKernel):
    """The delta rule with a decay per head and token, both from x.

    beta as DeltaNet's; the decay from the gate input ``a``: log alpha = -exp(A_log_h)
    softplus(a + dt_bias_h), A_h drawn in [1, 16] and dt_bias_h the inverse softplus of a
    step in [0.001, 0.1] (Mamba2's initialisation, as fla's Gated DeltaNet layer).

    Args:
        chunk_size, backend: as for every gated kernel (``GatedKernel``).
    """

    name = "gated_deltanet"
    delta_rule = True
    unit_keys = True  # its layer L2-normalises them (qk_norm)
    formula = "S ← αS(I − βkkᵀ) + βvkᵀ, o = S q/√d, α, β from x, causal"
    gate_inputs: ClassVar[dict[str, GateInput]] = {
        "beta": GateInput("sigmoid"),
        "a": GateInput("identity"),
    }

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        chunk_size: int = 64,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout, chunk_size, backend)
        self.A_log, self.dt_bias = mamba_decay_parameters(n_head)

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):  # type: ignore[override]
        return mamba_log_decay(gates["a"], self.A_log, self.dt_bias, like), gates["beta"]
