"""Kimi Delta Attention (KDA; Kimi Team, "Kimi Linear", arXiv 2510.26692, 2025): Gated
DeltaNet's delta rule with a decay per key channel, on the gated recurrence.

    S_t = Diag(alpha_t) S_{t-1},  S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T,
    o_t = S_t^T (q_t / sqrt(Dk))

with log alpha_t[d] = -exp(A_log_h) softplus(f_t[d] + dt_bias_h[d]): Mamba2's decay, one
per key channel (fla's ``fla/ops/kda/naive.py`` and ``fla/layers/kda.py``)."""

from __future__ import annotations

from torch import Tensor

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.gated.kernel import (
    GatedKernel,
    mamba_decay_parameters,
    mamba_log_decay,
)


class KDAAttention(GatedKernel):
    """The delta rule with a decay per head, token and key channel, both from x.

    beta = sigmoid(w_b . x), one per head and token, as DeltaNet's. The decay's input f
    comes from x through a bottleneck as wide as a head (fla's ``f_proj``), one number per
    key channel; log alpha = -exp(A_log_h) softplus(f + dt_bias_h), A_h drawn in [1, 16]
    and dt_bias the inverse softplus of a step in [0.001, 0.1], one per head and channel
    (Mamba2's initialisation, as fla's KDA layer).

    Args:
        chunk_size, backend: as for every gated kernel (``GatedKernel``); fla's op is
            ``chunk_kda``.
    """

    name = "kda"
    delta_rule = True
    unit_keys = True  # its layer L2-normalises them (qk_norm)
    formula = "S ← Diag(α)S, S += βk(v − Sᵀk)ᵀ, o = Sᵀq/√d, α per key channel, causal"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        chunk_size: int = 16,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout, chunk_size, backend)
        # the decay's bottleneck is a head wide (fla: head_v_dim), so it is set per instance
        self.gate_inputs = {
            "beta": GateInput("sigmoid"),
            "f": GateInput("identity", per_channel=True, rank=head_dim),
        }
        self.A_log, self.dt_bias = mamba_decay_parameters(n_head, self.qk_dim)

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):  # type: ignore[override]
        return mamba_log_decay(gates["f"], self.A_log, self.dt_bias, like), gates["beta"]
