"""Sigmoid attention (Ramapuram et al., "Theory, Analysis, and Best Practices for Sigmoid
Self-Attention", 2024): each key is weighed on its own, sigma(q·k/√D + b), with no
normalisation over the keys, and b = -log n, n the number of keys the query may see (so
that the weights start out summing to about 1, as the paper advises). Counting only the
visible keys keeps a causal query's weights the same in a full forward and in decoding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transformers_lab.attention.keywise import KeywiseAttention


class SigmoidAttention(KeywiseAttention):
    """Sigmoid attention, ``sigma(s q·k + b) v`` with rows that need not sum to 1.

    Args:
        scale: s; None means 1/sqrt(head_dim).
        bias: b; None means -log n, n the keys the query may see.
    """

    name = "sigmoid"
    formula = "σ(q·k/√D + b), b = −log n (not normalised)"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        scale: float | None = None,
        bias: float | None = None,
    ) -> None:
        super().__init__(head_dim, n_head, dropout, scale)
        self.bias = bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bias={self.bias}"

    def activate(self, scores: Tensor, n: Tensor) -> Tensor:
        return torch.sigmoid(scores + (-torch.log(n) if self.bias is None else self.bias))

    def reference_activate(self, scores: Tensor, n: Tensor) -> Tensor:
        """``1 / (1 + exp(-(s q·k + b)))``."""
        b = -torch.log(n) if self.bias is None else self.bias
        return 1.0 / (1.0 + torch.exp(-(scores + b)))
