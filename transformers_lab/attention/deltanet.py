"""DeltaNet (Schlag et al., 2021; Yang et al., "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length", 2024): the state moves its prediction for each key
towards the key's value, S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, on the
gated recurrence's delta rule."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.gated.kernel import GatedKernel


class DeltaNetAttention(GatedKernel):
    """The delta rule, its rate beta = sigmoid(w . x) per head and token from x.

    beta is the gate input ``beta``. Its layer L2-normalises the keys
    (``attention.qk_norm``, on in the preset): with |k| = 1 and beta in (0, 1) the state
    stays bounded.

    Args:
        chunk_size: as for every gated kernel (``GatedKernel``).
    """

    name = "deltanet"
    delta_rule = True
    unit_keys = True  # its layer L2-normalises them (qk_norm)
    formula = "S ← S(I − βkkᵀ) + βvkᵀ, o = S q/√d, β = σ(w·x), causal"
    gate_inputs: ClassVar[dict[str, GateInput]] = {"beta": GateInput("sigmoid")}

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):  # type: ignore[override]
        return None, gates["beta"]
