"""A scalar data-dependent decay (Mamba2's SSD form; fla's ``simple_gla``): the state
decays by one rate per head and token, alpha_t = sigmoid(w . x_t)^(1/tau), on the gated
recurrence."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.linear.gated_kernel import GatedKernel


class SimpleGLAAttention(GatedKernel):
    """A decay of one number per head and token, from x (Mamba2's form).

    S_t = alpha_t S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(D), log alpha_t =
    logsigmoid(w . x_t) / tau, one number per head and token (the gate input ``g``).

    Args:
        gate_normalizer: tau (16, as fla's GLA layers): a larger tau, a longer memory.
        chunk_size: as for every gated kernel (``GatedKernel``).
    """

    name = "simple_gla"
    formula = "q·k Πα/√d, α = σ(w·x)^(1/τ) per head, causal"
    gate_inputs: ClassVar[dict[str, GateInput]] = {"g": GateInput("logsigmoid")}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        chunk_size: int = 64,
        gate_normalizer: float = 16.0,
    ) -> None:
        super().__init__(head_dim, num_heads, dropout, chunk_size)
        if not gate_normalizer > 0:
            raise ValueError(f"simple_gla: gate_normalizer must be > 0, got {gate_normalizer!r}")
        self.gate_normalizer = float(gate_normalizer)

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):  # type: ignore[override]
        return gates["g"] / self.gate_normalizer, None
