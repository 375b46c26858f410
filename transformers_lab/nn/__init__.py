"""Layers shared by every model: multi-head attention around a kernel (``multihead``) and
the parts around the kernel, whose switches it owns (``parts``), mixers (``mixers``),
blocks, embeddings and positions (``layers``), rotary positions (``rotary``), the
weight-decay groups (``optim``), and the layer around a kernel checked (``check``)."""

from transformers_lab.nn.layers import (
    ACTIVATIONS,
    MLP,
    POSITIONAL_ENCODINGS,
    Block,
    PatchEmbedding,
    PositionalEncoding,
    TokenEmbedding,
    activation,
    checkpoint_blocks,
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
    "checkpoint_blocks",
    "sinusoidal_table",
    "weight_decay_groups",
]
