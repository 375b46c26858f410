"""A scalar data-dependent decay (Mamba2's SSD form; fla's ``simple_gla``): the state
decays by one rate per head and token, alpha_t = sigmoid(w . x_t)^(1/tau), on the gated
recurrence."""

from __future__ import annotations

from typing import ClassVar

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.gated.kernel import TemperedDecayKernel


class SimpleGLAAttention(TemperedDecayKernel):
    """A decay of one number per head and token, from x (Mamba2's form).

    S_t = alpha_t S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(D), log alpha_t =
    logsigmoid(w . x_t) / tau, one number per head and token (the gate input ``g``).

    Args:
        gate_normalizer: tau (16, as fla's GLA layers): a larger tau, a longer memory.
        chunk_size: as for every gated kernel (``GatedKernel``); both as
            ``TemperedDecayKernel``.
    """

    name = "simple_gla"
    formula = "q·k Πα/√d, α = σ(w·x)^(1/τ) per head, causal"
    gate_inputs: ClassVar[dict[str, GateInput]] = {"g": GateInput("logsigmoid")}
