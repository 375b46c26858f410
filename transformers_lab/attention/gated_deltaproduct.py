"""Gated DeltaProduct (Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs
via Householder Products", 2025): Gated DeltaNet with n_h delta-rule steps a token, each
with its own key, value and rate, on the gated recurrence.

    S = alpha_t S,  then for j = 1 .. n_h:  S = S (I - beta_tj k_tj k_tj^T) + beta_tj v_tj k_tj^T,
    o_t = S q_t / sqrt(Dk)

The state's transition is a product of n_h generalised Householder matrices (the state of
n_h keys a token: fla's ``fla/ops/gated_delta_product/naive.py``); with beta in (0, 2) each
has eigenvalues in (-1, 1], which lets the recurrence track states (a parity, a
permutation) that Gated DeltaNet's (0, 1] cannot. n_h = 1 is Gated DeltaNet, beta doubled.

It runs as Gated DeltaNet's recurrence over the sequence of its n_h N keys
(``GatedKernel.steps``): the decay at each token's first key, the query after its last."""

from __future__ import annotations

from torch import Tensor

from transformers_lab.attention.base import GateInput
from transformers_lab.attention.gated_deltanet import GatedDeltaNetAttention
from transformers_lab.errors import must_be


class GatedDeltaProductAttention(GatedDeltaNetAttention):
    """Gated DeltaNet with ``householder`` keys, values and rates a token.

    The layer projects k and v ``householder`` times as wide (fla's layout, (n_h, H, D) a
    token) and one rate a key (``GateInput(per_key=True)``); the decay is Gated DeltaNet's,
    one a head and token, from the gate input ``a``.

    Args:
        householder: n_h >= 1, the delta-rule steps (keys) a token; 2 in fla's layer and
            the paper's language models.
        negative_eigenvalues: beta = 2 sigmoid(w . x) in (0, 2), so that each step's
            I - beta k k^T has an eigenvalue in (-1, 1) (fla's ``allow_neg_eigval``, on
            by default there); false: beta in (0, 1), Gated DeltaNet's.
        chunk_size: the steps (keys) of a chunk of the chunked path: chunk_size / n_h
            tokens. backend: as for every gated kernel (``GatedKernel``); fla's op is
            ``chunk_gated_delta_product``.
    """

    name = "gated_deltaproduct"
    formula = "S ← αS, S ← S(I − βkkᵀ) + βvkᵀ n_h times, o = S q/√d, causal"
    labelled = ("householder",)

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        householder: int = 2,
        negative_eigenvalues: bool = True,
        chunk_size: int = 64,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout, chunk_size, backend)
        if isinstance(householder, bool) or not (isinstance(householder, int) and householder >= 1):
            why = must_be("householder", "an integer >= 1 (the keys a token)", householder)
            raise ValueError(f"{self.name}: {why}")
        self.householder = self.keys_per_token = householder
        self.negative_eigenvalues = bool(negative_eigenvalues)
        self.gate_inputs = {
            "beta": GateInput("sigmoid", per_key=True),
            "a": GateInput("identity"),
        }

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, householder={self.householder}, "
            f"negative_eigenvalues={self.negative_eigenvalues}"
        )

    def decay_and_rate(self, gates: dict[str, Tensor], like: Tensor):  # type: ignore[override]
        log_decay, beta = super().decay_and_rate(gates, like)
        return log_decay, 2 * beta if self.negative_eigenvalues else beta
