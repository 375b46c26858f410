"""Layers shared by every model."""

from transformers_lab.nn.attention import MultiHeadAttention, as_kernel_factory

__all__ = ["MultiHeadAttention", "as_kernel_factory"]
