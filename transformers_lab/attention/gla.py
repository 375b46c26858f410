"""Gated linear attention (Yang et al., "Gated Linear Attention Transformers with
Hardware-Efficient Training", 2024): the state decays by a data-dependent rate per key
channel, alpha_t = sigmoid(W x_t)^(1/tau), W of low rank, on the gated recurrence."""

from __future__ import annotations

from typing import ClassVar

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.gated.kernel import TemperedDecayKernel


class GLAAttention(TemperedDecayKernel):
    """GLA: a decay per key channel, from x through a rank-16 projection.

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(D), with
    log alpha_t = logsigmoid(W x_t) / tau, one per key channel, W through a rank-16
    bottleneck (the layer projects it from x: the gate input ``gk``).

    Args:
        gate_normalizer: tau (GLA: 16): a larger tau keeps alpha nearer 1, a longer memory.
        chunk_size: as for every gated kernel (``GatedKernel``); both as
            ``TemperedDecayKernel``.
    """

    name = "gla"
    formula = "q·(k ⊙ Πα)/√d, α = σ(W x)^(1/τ) per key channel, causal"
    gate_inputs: ClassVar[dict[str, GateInput]] = {
        "gk": GateInput("logsigmoid", per_channel=True, rank=16)
    }
