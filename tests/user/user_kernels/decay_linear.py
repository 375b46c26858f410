# tests/user/user_kernels/decay_linear.py
"""Linear attention with elu + 1 features, its state decayed by a rate per head and token
taken from x: S_t = a_t S_{t-1} + phi(k_t) v_t^T, o_t = S_t^T phi(q_t) / sqrt(D)."""

import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.gated.kernel import GatedKernel


class DecayLinearAttention(GatedKernel):
    """phi = elu + 1 on q and k; log a_t = logsigmoid(w . x_t) / tau, per head."""

    name = "decay_linear"
    formula = "φ(q)·φ(k) Πa/√d, φ = elu + 1, a = σ(w·x)^(1/τ) per head, causal"
    # g: logsigmoid(w . x), (B, H, N); the layer projects it from x and passes it as g=
    gate_inputs = {"g": GateInput("logsigmoid")}

    def __init__(self, head_dim, n_head, dropout=0.0, chunk_size=64, tau=8.0, backend="auto"):
        super().__init__(head_dim, n_head, dropout, chunk_size, backend)
        self.tau = tau

    def feature_map(self, x: Tensor) -> Tensor:  # of q and of k, (B, H, N, D) -> same shape
        return F.elu(x) + 1

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):
        return gates["g"] / self.tau, None  # the log decay, (B, H, N), <= 0; no delta rule
