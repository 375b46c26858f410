"""Fastmax: factorizable polynomial attention (Gerami et al., "FAST: Factorizable Attention
for Speeding up Transformers", arXiv 2402.07901, 2024).

The softmax's exponential is replaced by its Taylor polynomial of order p (1 or 2)::

    a_ij = f(x_ij) / sum_j f(x_ij),   x_ij = s * q_i . k_j,   f(x) = sum_{m<=p} x^m / m!

With u~ = [1, u], f factorises: p=1 is f = q~ . k~, and p=2 is
f(x) = (1 + x)^2 / 2 + 1/2 = sum_f w_f phi_f(q) phi_f(k), where phi(u) holds the products
u~_a u~_b of the symmetric half of u~ (x) u~: 1, u, and each pair of u once,
1 + D + D(D+1)/2 features for even D. The weights w fold in the 1/2 and the fact that
(q~ . k~)^2 counts a square once and a pair twice. So the numerator
``sum_j f(x_ij) v_j = phi(q_i) @ sum_j w * phi(k_j) v_j^T`` costs O(N * D^p * Dv), not O(N^2).

Every path works on ``v_aug = [v, 1]`` with masked keys zeroed: its last column carries
the denominator, so one product gives numerator and normaliser together. The four paths,
one module each, agree to rounding:

- ``naive``: ``quadratic``, the N x N polynomial, the reference (and what ``weights``
  returns);
- ``factorized``: non-causal, one state ``sum_j v_aug_j (w * phi(k_j))^T``;
- ``chunked``: ``chunked_causal``, the exact polynomial of the C x C scores inside each
  chunk, and a running prefix state across chunks (never an N x D^p x Dv tensor);
- ``recurrent``: ``recurrent_step``, one new token, state in and state out, O(1) work per
  token.

``features`` holds phi, its weights and its vector-Jacobian product (and p = 0, features
a kernel computed itself); ``feature_kernel`` the module every linear kernel is, which
picks a path; ``kernel`` fastmax's own features.

States are stored value-major, (B, H, Dv + 1, F), so that the gradients w.r.t. the
features come out of the matrix products contiguous.
"""

from transformers_lab.attention.fastmax.chunked import chunked_causal
from transformers_lab.attention.fastmax.factorized import factorized
from transformers_lab.attention.fastmax.feature_kernel import (
    FeatureKernel,
    normalise_output,
    safe_divide,
)
from transformers_lab.attention.fastmax.features import (
    SUPPORTED_P,
    feature_dim,
    feature_map,
    feature_weights,
    features_t,
    features_t_vjp,
    poly,
    read_state,
    weighted_state,
)
from transformers_lab.attention.fastmax.kernel import FastmaxAttention
from transformers_lab.attention.fastmax.naive import polynomial_matrix, quadratic
from transformers_lab.attention.fastmax.recurrent import recurrent_step

__all__ = [
    "SUPPORTED_P",
    "FastmaxAttention",
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
