"""A researcher's own kernel, kept outside the package as a user's would be: ReLU² linear
attention, phi(x) = relu(x)² + eps, on the project's linear engine. The tests of
first-class user kernels use it, with ``my_conf/attention/relu2.yaml`` on
``hydra.searchpath``."""

import torch
from torch import Tensor

from transformers_lab.attention import FeatureKernel, naive

EPS = 1e-6  # keeps every weight positive, so that every row sums to 1


class ReLU2Attention(FeatureKernel):
    """ReLU² linear attention, phi(x) = relu(x)² + eps."""

    name = "relu2"
    formula = "φ(q)·φ(k) normalised over keys, φ = relu² + ε"

    def __init__(self, head_dim, n_head, dropout=0.0, chunk_size=128, impl="auto"):
        super().__init__(head_dim, n_head, dropout, p=0, chunk_size=chunk_size, impl=impl)

    def features(self, x: Tensor, role: str) -> Tensor:
        return torch.relu(x).square() + EPS

    def reference_weights(self, q, k, *, causal=False, key_padding_mask=None):
        def phi(x: Tensor) -> Tensor:
            x = x.double()
            return torch.where(x > 0, x * x, torch.zeros_like(x)) + EPS

        f = naive.dot(phi(q), phi(k))
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))
