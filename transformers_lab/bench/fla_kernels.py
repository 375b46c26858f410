"""fla's Triton ops alone, as kernels the bench can time: the reference that our
``backend=fla`` (``attention.fla_ops``), which adds our feature maps, layout and
normalisation around the same op, is held to on a GPU.

- ``linear_fla_op``: ``chunk_linear_attn``, normalised, on elu + 1 features (our ``linear``);
- ``based_fla_op``: ``fused_chunk_based`` on 16-wide queries and keys (our ``based``);
- ``fastmax_p2_fla_op``: ``parallel_based`` on unit queries and keys (our ``fastmax_p2``);
- ``fastmax_p1_fla_op``: ``chunk_linear_attn`` on [1, unit q] and [1, unit k] (``fastmax_p1``).

The gated kernels' ``backend=fla`` is fla's op with only a change of layout around it.
Bench-only: causal self-attention, no padding, no decoding; CUDA with fla installed
(refused in one line otherwise).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.backends import unavailable
from transformers_lab.attention.base import AttentionKernel


class _FlaKernel(AttentionKernel, register=False):
    """A bench kernel on one of fla's ops (see the module doc)."""

    def __init__(self, head_dim: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__(head_dim, n_head, dropout)
        if why := unavailable("fla"):
            raise ValueError(f"{type(self).__name__} cannot run here: {why}")

    def op(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None, **_: Any) -> Tensor:  # type: ignore[override]
        if not causal or key_padding_mask is not None or q.shape[2] != k.shape[2]:
            raise ValueError(f"{type(self).__name__} times causal self-attention, unpadded")
        layout = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # fla's (B, N, H, D)
        return self.op(*layout).transpose(1, 2)

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        return 0  # not a decoder: the bench's state column does not apply


class FlaLinearAttention(_FlaKernel):
    """fla's ``chunk_linear_attn``, normalised, on elu + 1 features: our ``linear``."""

    def op(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ops = importlib.import_module("fla.ops.linear_attn")
        o, _ = ops.chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v, scale=1.0, normalize=True)
        return o


class FlaBasedAttention(_FlaKernel):
    """fla's ``fused_chunk_based``: Based's 2nd-order Taylor map of exp on 16-wide q and k,
    normalised: our ``based``."""

    def __init__(self, head_dim: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__(head_dim, n_head, dropout)
        self.qk_dim = 16

    def op(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ops = importlib.import_module("fla.ops.based")
        return ops.fused_chunk_based(q, k, v, scale=0.25, use_norm=True)


class FlaFastmaxP2(_FlaKernel):
    """fla's ``parallel_based`` on unit queries and keys: 1 + x + x^2/2 of their cosine,
    normalised, our ``fastmax_p2`` (scale 1)."""

    def op(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ops = importlib.import_module("fla.ops.based")
        return ops.parallel_based(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, scale=1.0)


class FlaFastmaxP1(_FlaKernel):
    """fla's ``chunk_linear_attn`` on [1, unit q] and [1, unit k]: 1 + cos(q, k),
    normalised, our ``fastmax_p1`` (scale 1)."""

    def op(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ops = importlib.import_module("fla.ops.linear_attn")

        def lifted(x: Tensor) -> Tensor:
            return torch.cat([torch.ones_like(x[..., :1]), F.normalize(x, dim=-1)], dim=-1)

        o, _ = ops.chunk_linear_attn(lifted(q), lifted(k), v, scale=1.0, normalize=True)
        return o
