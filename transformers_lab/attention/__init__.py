"""Attention kernels: the interchangeable core of every model.

Each kernel is an ``nn.Module`` built per layer as ``factory(head_dim=..., num_heads=...)``
and called as ``kernel(q, k, v, causal=..., key_padding_mask=...)``; see ``base`` for the
contract. ``build_kernel("fastmax", head_dim=32, num_heads=4, p=2)`` builds one by name.
"""

from __future__ import annotations

from typing import Any

from transformers_lab.attention.additive import AdditiveAttention
from transformers_lab.attention.base import (
    AttentionKernel,
    Memory,
    attention_mask,
    masked_softmax,
)
from transformers_lab.attention.fastmax import FastmaxAttention
from transformers_lab.attention.softmax import CosineAttention, DotAttention, SoftmaxAttention

KERNELS: dict[str, type[AttentionKernel]] = {
    cls.name: cls
    for cls in (
        SoftmaxAttention,
        DotAttention,
        CosineAttention,
        AdditiveAttention,
        FastmaxAttention,
    )
}


def kernel_class(name: str) -> type[AttentionKernel]:
    """The kernel class registered under ``name``."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention kernel {name!r}; valid kernels are: {', '.join(KERNELS)}"
        ) from None


def build_kernel(name: str, *, head_dim: int, num_heads: int, **options: Any) -> AttentionKernel:
    """Build the kernel ``name`` for one layer, with its kernel-specific ``options``."""
    return kernel_class(name)(head_dim=head_dim, num_heads=num_heads, **options)


__all__ = [
    "KERNELS",
    "AdditiveAttention",
    "AttentionKernel",
    "CosineAttention",
    "DotAttention",
    "FastmaxAttention",
    "Memory",
    "SoftmaxAttention",
    "attention_mask",
    "build_kernel",
    "kernel_class",
    "masked_softmax",
]
