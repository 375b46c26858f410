"""Attention kernels: the interchangeable core of every model.

Each kernel is an ``nn.Module`` built per layer as ``factory(head_dim=..., n_head=...)``
and called as ``kernel(q, k, v, causal=..., key_padding_mask=...)``; see ``base`` for the
contract. A kernel class registers itself under its ``name`` when its module is imported;
every module of this package is imported here, so a new kernel is one file (and its yaml
in ``conf/attention/``). ``build_kernel("fastmax", head_dim=32, n_head=4, p=2)`` builds
one by name; ``tlab-check NAME`` checks one against the contract (``check``).
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import partial
from typing import Any

from transformers_lab.attention.base import REGISTRY, AttentionKernel, Memory
from transformers_lab.attention.contract import call_with_heads
from transformers_lab.attention.masks import attention_mask, masked_softmax

# import every kernel module of the package, so that its classes register themselves
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name not in (
        "base",
        "naive",
        "check",
        "testbed",
        "resolve",
    ):
        importlib.import_module(f"{__name__}.{_module.name}")

from transformers_lab.attention.additive import AdditiveAttention  # noqa: E402
from transformers_lab.attention.fastmax import FastmaxAttention  # noqa: E402
from transformers_lab.attention.feature_map import FeatureKernel  # noqa: E402
from transformers_lab.attention.softmax import (  # noqa: E402
    CosineAttention,
    DotAttention,
    SoftmaxAttention,
)

KERNELS = REGISTRY  # the registered kernels, by name (the user's own included, once imported)


def kernel_class(name: str) -> type[AttentionKernel]:
    """The kernel class registered under ``name``."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention kernel {name!r}; valid kernels are: {', '.join(sorted(REGISTRY))}"
        ) from None


def build_kernel(name: str, *, head_dim: int, n_head: int, **options: Any) -> AttentionKernel:
    """Build the kernel ``name`` for one layer, with its kernel-specific ``options``."""
    return call_with_heads(partial(kernel_class(name), **options), n_head, head_dim=head_dim)


__all__ = [
    "KERNELS",
    "REGISTRY",
    "AdditiveAttention",
    "AttentionKernel",
    "CosineAttention",
    "DotAttention",
    "FastmaxAttention",
    "FeatureKernel",
    "Memory",
    "SoftmaxAttention",
    "attention_mask",
    "build_kernel",
    "call_with_heads",
    "kernel_class",
    "masked_softmax",
]
