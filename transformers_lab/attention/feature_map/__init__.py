"""The feature-map engine: the paths every linear kernel of a feature map runs on.

A linear kernel (``FeatureKernel``) maps queries and keys to features u and weighs key j
for query i by ``f(u_q_i . u_k_j)``, normalised over the keys, with f a polynomial of
order p (``features.poly``): fastmax and Based take p = 1 or 2, whose monomials the
engine expands itself; kernels that compute their features outright (elu + 1, random
features, cosFormer) take p = 0 and f(x) = x. With u~ = [1, u], the polynomial of order 2
factorises as f(x) = (1 + x)^2 / 2 + 1/2 = sum_f w_f phi_f(q) phi_f(k), where phi(u)
holds the products u~_a u~_b of the symmetric half of u~ (x) u~ (1, u and each pair of u
once), so ``sum_j f(x_ij) v_j = phi(q_i) @ sum_j w * phi(k_j) v_j^T`` costs
O(N * F * Dv), not O(N^2).

Every path works on ``v_aug = [v, 1]`` with masked keys zeroed: its last column carries
the denominator, so one product gives numerator and normaliser together. The four paths,
one module each, agree to rounding:

- ``quadratic``: the explicit N x N polynomial, the reference (and what ``weights``
  returns);
- ``factorized``: non-causal, one state ``sum_j v_aug_j (w * phi(k_j))^T``;
- ``chunked``: ``chunked_causal``, the exact polynomial of the C x C scores inside each
  chunk, and a running prefix state across chunks (never an N x F x Dv tensor);
- ``recurrent``: ``recurrent_step``, one new token, state in and state out, O(1) work per
  token.

``features`` holds phi, its weights and its vector-Jacobian product; ``steps`` one chunk
step of the chunked and factorized paths (compiled or not); ``feature_kernel`` the module
every linear kernel is, which picks a path. The kernels themselves (fastmax, Based,
elu + 1, Performer, cosFormer) live one file each in ``attention/``, each with its own
float64 reference.

States are stored value-major, (B, H, Dv + 1, F), so that the gradients w.r.t. the
features come out of the matrix products contiguous.
"""

from transformers_lab.attention.feature_map.chunked import chunked_causal
from transformers_lab.attention.feature_map.factorized import factorized
from transformers_lab.attention.feature_map.feature_kernel import FeatureKernel, normalise_output
from transformers_lab.attention.feature_map.features import (
    SUPPORTED_P,
    feature_dim,
    feature_map,
    feature_weights,
    features_t,
    features_t_vjp,
    poly,
    read_state,
    safe_divide,
    weighted_state,
)
from transformers_lab.attention.feature_map.quadratic import polynomial_matrix, quadratic
from transformers_lab.attention.feature_map.recurrent import recurrent_step

__all__ = [
    "SUPPORTED_P",
    "FeatureKernel",
    "chunked_causal",
    "factorized",
    "feature_dim",
    "feature_map",
    "feature_weights",
    "features_t",
    "features_t_vjp",
    "normalise_output",
    "poly",
    "polynomial_matrix",
    "quadratic",
    "read_state",
    "recurrent_step",
    "safe_divide",
    "weighted_state",
]
