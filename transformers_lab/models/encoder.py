"""Encoder-only classifiers: a generic one over tokens or image patches, and ViT."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor, nn

from transformers_lab.models.common import Hybrid, block_stack, check_sizes, final_norm
from transformers_lab.nn import (
    KernelFactory,
    PatchEmbedding,
    PositionalEncoding,
    TokenEmbedding,
    activation,
    checkpoint_blocks,
)

POOLINGS = ("cls", "mean", "none")
HEADS = ("linear", "mlp")


class EncoderClassifier(nn.Module):
    """Embedding, a stack of non-causal Blocks, pooling and a classification head.

    The input is either token ids (give ``vocab_size``) or images cut into patches (give
    ``image_size`` and ``patch_size``).

    Args:
        num_classes: classes of the head.
        vocab_size, block_size: token input; ``block_size`` is the context, the
            positions table.
        image_size, patch_size, in_channels: patch input (square images).
        patch_stride, patch_padding: the patch convolution's stride (None: the patch size,
            non-overlapping patches) and zero padding of the image border.
        d_model, n_layer, n_head, mlp_ratio, dropout, act, bias, norm_first: as in GPT.
        pos_encoding: sinusoidal, learned, fourier, rope, alibi or none.
        rope_theta: the base of RoPE's frequencies (``pos_encoding=rope``).
        pool: ``cls`` (a learned class token, prepended), ``mean`` (average over the
            non-padded tokens) or ``none`` (a prediction per token).
        head: ``linear``, or ``mlp`` (Linear, activation, Linear).
        pad_id: token id to mask out of attention and of mean pooling.
        attention: kernel factory or kernel name.
        hybrid: each layer's attention, where they differ, as in GPT
            (``models.common.layer_choices``).
        activation_checkpointing: recompute each block's activations in the backward
            pass, as in GPT.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        vocab_size: int | None = None,
        block_size: int = 512,
        image_size: int | None = None,
        patch_size: int | None = None,
        patch_stride: int | None = None,
        patch_padding: int = 0,
        in_channels: int = 1,
        d_model: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        act: str = "gelu",
        bias: bool = True,
        norm_first: bool = True,
        pos_encoding: str = "sinusoidal",
        rope_theta: float = 10000.0,
        pool: str = "mean",
        head: str = "linear",
        pad_id: int | None = None,
        attention: KernelFactory | str = "softmax",
        hybrid: Hybrid = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(dropout, n_layer=n_layer, n_head=n_head, d_model=d_model)
        patches = (image_size is not None, patch_size is not None)
        if patches[0] != patches[1] or (vocab_size is not None) == patches[0]:
            raise ValueError(
                "give either vocab_size (token input) or image_size and patch_size "
                f"(patch input), not both and not neither; got vocab_size={vocab_size}, "
                f"image_size={image_size}, patch_size={patch_size} (for token data, pixel "
                "sequences among them, set patch_size=null)"
            )
        if pool not in POOLINGS:
            raise ValueError(f"unknown pool {pool!r}; valid ones are: {', '.join(POOLINGS)}")
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; valid ones are: {', '.join(HEADS)}")
        self.pool, self.pad_id = pool, pad_id
        if vocab_size is not None:
            self.embedding: nn.Module = TokenEmbedding(vocab_size, d_model)
        else:
            self.embedding = PatchEmbedding(
                image_size, patch_size, in_channels, d_model, patch_stride, patch_padding
            )
            block_size = self.embedding.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model)) if pool == "cls" else None
        self.context = block_size + (pool == "cls")  # the tokens a layer attends over
        # fixed positions as large as the tokens: nn.Embedding draws N(0, 1), and sines and
        # cosines have a root mean square of 1/sqrt(2); patches keep the plain table
        scale = math.sqrt(2) if vocab_size is not None else 1.0
        self.pos = PositionalEncoding(pos_encoding, d_model, self.context, scale)
        self.drop = nn.Dropout(dropout)
        self.blocks = block_stack(
            n_layer,
            d_model,
            n_head,
            attention,
            hybrid=hybrid,
            mlp_ratio=mlp_ratio,
            act=act,
            dropout=dropout,
            bias=bias,
            norm_first=norm_first,
            rope_theta=rope_theta if pos_encoding == "rope" else None,
            alibi=pos_encoding == "alibi",
            who=f"the {type(self).__name__}",
            causal=False,
            context=self.context,
        )
        self.norm = final_norm(d_model, bias, norm_first)
        if head == "linear":
            self.head: nn.Module = nn.Linear(d_model, num_classes)
        else:
            self.head = nn.Sequential(
                nn.Linear(d_model, d_model), activation(act), nn.Linear(d_model, num_classes)
            )
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)
        checkpoint_blocks(self, activation_checkpointing)

    def features(
        self, x: Tensor, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Encoded tokens (B, N, d_model) and the padding mask they carry (B, N) or None."""
        if key_padding_mask is None and self.pad_id is not None and not x.is_floating_point():
            key_padding_mask = x == self.pad_id
        h = self.embedding(x)  # (B, N, d_model)
        if self.cls_token is not None:
            h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
            if key_padding_mask is not None:
                key_padding_mask = nn.functional.pad(key_padding_mask, (1, 0), value=False)
        h = self.drop(self.pos(h))
        for block in self.blocks:
            h = block(h, key_padding_mask=key_padding_mask)
        return self.norm(h), key_padding_mask

    def state_size(self, n: int | None = None) -> int:
        """Numbers the attention holds of a sequence of ``n`` tokens (default: its whole
        context) per sequence, all layers and heads: softmax's keys and values grow with
        n, a factorised kernel's state does not; the same count as a decoder's state with
        these kernels (``GPT.state_size``)."""
        n = self.context if n is None else n
        return sum(block.mixer.state_size(n) for block in self.blocks)

    @property
    def num_patches(self) -> int | None:
        """Patches an image becomes (None for token input)."""
        return self.embedding.num_patches if isinstance(self.embedding, PatchEmbedding) else None

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens the encoder sees before the input's own: the class token, if any."""
        return int(self.cls_token is not None)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """Logits (B, classes), or (B, N, classes) with ``pool='none'``.

        x: token ids (B, N) or images (B, C, H, W); key_padding_mask: (B, N), True at
        padding (derived from ``pad_id`` when not given).
        """
        h, mask = self.features(x, key_padding_mask)
        if self.pool == "cls":
            h = h[:, 0]
        elif self.pool == "mean":
            if mask is None:
                h = h.mean(dim=1)
            else:
                keep = (~mask).unsqueeze(-1).to(h.dtype)
                h = (h * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0)
        return self.head(h)


class ViT(EncoderClassifier):
    """Vision Transformer (Dosovitskiy et al., 2021): convolutional patch embedding, a
    class token (or mean pooling), learned positions and a linear (or MLP) head.

    It takes ``EncoderClassifier``'s arguments for patch input, all by keyword (not the
    token ones: ``vocab_size``, ``block_size``, ``pad_id``), with the defaults of ``DEFAULTS``:
    28x28 one-channel images in 4x4 patches, 10 classes, 4 layers, learned positions and a
    class token.
    """

    DEFAULTS: dict[str, Any] = {
        "num_classes": 10,
        "image_size": 28,
        "patch_size": 4,
        "in_channels": 1,
        "n_layer": 4,
        "pos_encoding": "learned",
        "pool": "cls",
    }
    TOKEN_ONLY = ("vocab_size", "block_size", "pad_id")

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(inspect.signature(ViT).parameters))
        if unknown:
            raise TypeError(f"ViT takes no {', '.join(unknown)} (an EncoderClassifier does)")
        super().__init__(**(self.DEFAULTS | options))


KEYWORD = inspect.Parameter.KEYWORD_ONLY
# ViT's signature is EncoderClassifier's for patch input with ViT's defaults: what Hydra,
# the model-against-data check and help() read
ViT.__signature__ = inspect.Signature(
    [
        param.replace(
            kind=inspect.Parameter.KEYWORD_ONLY, default=ViT.DEFAULTS.get(name, param.default)
        )
        for name, param in inspect.signature(EncoderClassifier).parameters.items()
        if name not in ViT.TOKEN_ONLY
    ]
)
