"""Layers shared by every model: multi-head attention around a kernel (``attention``),
blocks, embeddings and positions (``layers``), rotary positions (``rotary``), and the
weight-decay groups (``optim``)."""

from transformers_lab.nn.layers import (
    ACTIVATIONS,
    MLP,
    POSITIONAL_ENCODINGS,
    Block,
    PatchEmbedding,
    PositionalEncoding,
    TokenEmbedding,
    activation,
    sinusoidal_table,
)
from transformers_lab.nn.multihead import (
    Context,
    KernelFactory,
    MultiHeadAttention,
    as_kernel_factory,
)
from transformers_lab.nn.optim import weight_decay_groups

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "POSITIONAL_ENCODINGS",
    "Block",
    "Context",
    "KernelFactory",
    "MultiHeadAttention",
    "PatchEmbedding",
    "PositionalEncoding",
    "TokenEmbedding",
    "activation",
    "as_kernel_factory",
    "sinusoidal_table",
    "weight_decay_groups",
]
