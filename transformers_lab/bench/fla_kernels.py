"""fla's Triton kernels for linear attention and Based, as kernels the bench can time.

The kernel bench (``bench.kernels``) times these beside ours on a GPU: ``fla_linear`` is
fla's ``chunk_linear_attn`` on elu + 1 features (our ``linear``), ``fla_based`` its
``fused_chunk_based`` on 16-wide queries and keys (our ``based``). The gated kernels need
no adapter: their ``backend=fla`` option runs fla's op for their recurrence
(``attention.linear.fla_ops``; the bench's ``<option>_fla`` variants).

Bench-only: causal self-attention, no padding, no decoding; CUDA with
flash-linear-attention installed (refused in one line otherwise).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.linear.fla_ops import unavailable


class _FlaKernel(AttentionKernel, register=False):
    """A bench kernel on one of fla's ops (see the module doc)."""

    def __init__(self, head_dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__(head_dim, num_heads, dropout)
        if why := unavailable():
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
        o, _ = ops.chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v, normalize=True)
        return o


class FlaBasedAttention(_FlaKernel):
    """fla's ``fused_chunk_based``: Based's 2nd-order Taylor map of exp on 16-wide q and k,
    normalised: our ``based``."""

    def __init__(self, head_dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__(head_dim, num_heads, dropout)
        self.qk_dim = 16

    def op(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ops = importlib.import_module("fla.ops.based")
        return ops.fused_chunk_based(q, k, v, use_norm=True)
