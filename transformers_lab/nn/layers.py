"""Building blocks shared by every model: activations, MLP, positions, embeddings, Block."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from transformers_lab.attention import AttentionKernel, call_with_heads
from transformers_lab.errors import must_be
from transformers_lab.nn.multihead import Context, KernelFactory, MultiHeadAttention

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "gelu_tanh": partial(nn.GELU, approximate="tanh"),
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "leaky_relu": nn.LeakyReLU,
    "elu": nn.ELU,
    "mish": nn.Mish,
}
POSITIONAL_ENCODINGS = ("sinusoidal", "learned", "fourier", "rope", "alibi", "none")


def activation(name: str) -> nn.Module:
    """The activation module called ``name``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; valid ones are: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear, activation, Linear, dropout."""

    def __init__(
        self,
        d_model: int,
        hidden: int,
        act: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.act = activation(act)
        self.proj = nn.Linear(hidden, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """Vaswani et al.'s table: PE[p, 2i] = sin(p w_i), PE[p, 2i+1] = cos(p w_i),
    w_i = 10000^(-2i / d_model). Shape (max_len, d_model)."""
    position = torch.arange(max_len, dtype=torch.float32)[:, None]
    freqs = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(1e4) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * freqs)
    table[:, 1::2] = torch.cos(position * freqs[: d_model // 2])
    return table


class PositionalEncoding(nn.Module):
    """Position vectors added to the token embeddings.

    Kinds:
        sinusoidal: the fixed table of Vaswani et al. (2017).
        learned: one trained vector per position (GPT, ViT), init N(0, 0.02).
        fourier: learned Fourier features: sin and cos of the position times learned
            frequencies (initialised to the sinusoidal ones), so the model can retune
            the frequencies of the fixed table.
        rope: nothing added here: the blocks rotate queries and keys instead (RoPE,
            ``nn.rotary``; models pass ``rope_theta`` to their self-attention).
        alibi: nothing added here: the kernels add a head-sloped distance bias to their
            scores (ALiBi, ``AttentionKernel.use_alibi``).
        none: no positions (the attention kernel sees a bag of tokens).

    ``scale`` multiplies the sinusoidal and fourier vectors (sines and cosines, whose
    entries have a root mean square of 1/sqrt(2)). A model sets it so that they are as
    large as its token embeddings: GPT's are drawn from N(0, 0.02), and the plain table,
    35 times larger, drowned them (a GPT with fixed positions learned nothing in a few
    hundred steps). The scale is a learned gain (as in the "scaled sinusoidal" positions
    of Hua et al., 2022), so training can still weigh positions against tokens.

    A table (learned, sinusoidal) refuses a sequence longer than ``block_size``, the
    model's context; the other kinds run past it (evaluation at other lengths, generation
    on the decoding state).
    """

    TABLES = ("learned", "sinusoidal")

    def __init__(self, kind: str, d_model: int, block_size: int, scale: float = 1.0) -> None:
        super().__init__()
        if kind not in POSITIONAL_ENCODINGS:
            raise ValueError(
                f"unknown positional encoding {kind!r}; valid ones are: "
                f"{', '.join(POSITIONAL_ENCODINGS)}"
            )
        if kind in ("sinusoidal", "fourier") and d_model % 2:
            raise ValueError(f"{kind} positions need an even d_model, got d_model={d_model}")
        if scale <= 0:
            raise ValueError(f"the scale of the positions must be > 0, got {scale}")
        self.kind = kind
        self.block_size = block_size
        self.bounded = kind in self.TABLES  # no position past block_size
        if kind == "sinusoidal":
            self.register_buffer("table", sinusoidal_table(block_size, d_model), persistent=False)
        elif kind == "learned":
            self.embedding = nn.Embedding(block_size, d_model)
            nn.init.normal_(self.embedding.weight, std=0.02)
        elif kind == "fourier":
            freqs = torch.exp(torch.arange(0, d_model, 2) * (-math.log(1e4) / d_model))
            self.freqs = nn.Parameter(freqs)
        if kind in ("sinusoidal", "fourier"):
            self.gain = nn.Parameter(torch.tensor(float(scale)))

    def table_rows(self, length: int, offset: int = 0) -> Tensor | None:
        """Position vectors of positions ``offset .. offset + length - 1``, (length, d_model),
        or None for ``none``. Only a table (learned, sinusoidal) ends at ``block_size``:
        the others go on past it (``bounded``)."""
        if self.bounded and offset + length > self.block_size:
            raise ValueError(
                f"a sequence of {offset + length} tokens is longer than the positions table "
                f"(block_size={self.block_size}); crop the input or build the model with a "
                "longer context (model.block_size)"
            )
        if self.kind in ("none", "rope", "alibi"):
            return None
        if self.kind == "fourier":
            position = torch.arange(offset, offset + length, device=self.freqs.device)
            angles = position[:, None].to(self.freqs.dtype) * self.freqs  # (T, d_model / 2)
            return self.gain * torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)
        if self.kind == "learned":
            return self.embedding.weight[offset : offset + length]
        return self.gain * self.table[offset : offset + length]

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        """x (B, T, d_model) plus the vectors of positions ``offset .. offset + T - 1``."""
        rows = self.table_rows(x.shape[1], offset)
        return x if rows is None else x + rows


class TokenEmbedding(nn.Embedding):
    """nn.Embedding that names the bad id when a token falls outside the vocabulary."""

    def forward(self, idx: Tensor) -> Tensor:  # type: ignore[override]
        if idx.is_cuda:  # checked on the device, without a host sync
            ok = ((idx >= 0) & (idx < self.num_embeddings)).all()
            torch._assert_async(ok, f"token id outside the vocabulary [0, {self.num_embeddings})")
        elif idx.numel() and (idx.min() < 0 or idx.max() >= self.num_embeddings):
            bad = idx[(idx < 0) | (idx >= self.num_embeddings)][0].item()
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {self.num_embeddings}); "
                "check that the tokenizer and the model's vocab_size agree"
            )
        return super().forward(idx)


class PatchEmbedding(nn.Module):
    """Cuts an image into patches and embeds each with one convolution.

    (B, C, H, W) -> (B, G * G, d_model), patches in row-major order, where the grid side
    is G = (image_size + 2 * padding - patch_size) / stride + 1. The default stride is the
    patch size (non-overlapping patches, G = image_size / patch_size); a smaller stride
    gives overlapping patches, ``padding`` zero-pads the border first.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        d_model: int,
        stride: int | None = None,
        padding: int = 0,
    ) -> None:
        super().__init__()
        if patch_size < 1:
            raise ValueError(must_be("patch_size", "an integer >= 1", patch_size))
        stride = patch_size if stride is None else stride
        if stride < 1 or padding < 0:
            raise ValueError(f"need patch stride >= 1 and padding >= 0, got {stride}, {padding}")
        span = image_size + 2 * padding - patch_size
        if span < 0 or span % stride:
            raise ValueError(
                f"image_size={image_size} does not fit the patch grid: image_size + 2 * "
                f"padding ({2 * padding}) - patch_size ({patch_size}) = {span} is not a "
                f"non-negative multiple of the stride {stride}; choose a patch size, stride "
                "or padding that tiles the image"
            )
        self.image_size = image_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.num_patches = (span // stride + 1) ** 2
        self.proj = nn.Conv2d(
            in_channels, d_model, kernel_size=patch_size, stride=stride, padding=padding
        )

    def forward(self, images: Tensor) -> Tensor:
        if images.dim() != 4 or images.shape[1] != self.in_channels:
            raise ValueError(
                f"expected images of shape (batch, {self.in_channels}, {self.image_size}, "
                f"{self.image_size}) with in_channels={self.in_channels}, got "
                f"{tuple(images.shape)}; set in_channels to the images' channel count"
            )
        if images.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"expected {self.image_size}x{self.image_size} images (image_size="
                f"{self.image_size}), got {images.shape[-2]}x{images.shape[-1]}; resize them "
                "or build the model with their size"
            )
        return self.proj(images).flatten(2).transpose(1, 2)  # (B, num_patches, d_model)


def is_mixer(factory: Any) -> bool:
    """Whether a layer's choice builds a whole mixer (``nn.mixers``: it takes d_model, and
    projects for itself) rather than a kernel for multi-head attention."""
    cls = getattr(factory, "func", factory)
    return (
        isinstance(cls, type)
        and issubclass(cls, nn.Module)
        and not issubclass(cls, AttentionKernel)
    )


def sequence_mixer(d_model: int, n_head: int, choice: Any, **attention: Any) -> nn.Module:
    """A layer's sequence mixer: the mixer ``choice`` builds (BaseConv: no positions), or
    multi-head attention around the kernel it names, with ``attention``'s options (bias,
    dropout, rope_theta, alibi)."""
    if is_mixer(choice):
        return call_with_heads(choice, n_head, d_model=d_model)
    return MultiHeadAttention(d_model, n_head, choice, **attention)


def _sublayer(
    x: Tensor, norm: nn.Module, fn: Callable[[Tensor], Tensor], norm_first: bool
) -> Tensor:
    """A residual sub-layer: x + f(norm(x)) (pre-norm) or norm(x + f(x)) (post-norm)."""
    return x + fn(norm(x)) if norm_first else norm(x + fn(x))


# a Block's parts as an earlier version named them in a state dict, and their names now
RENAMED_PARTS = {"attn": "mixer", "norm_attn": "norm_mixer"}
OLD_PART = re.compile(r"(^|\.)(\d+)\.(attn|norm_attn)\.")


def migrate_block_keys(state_dict: dict[str, Any], prefix: str | None = None) -> int:
    """Rename, in place, the keys an earlier version gave a Block's parts (``blocks.0.attn``
    is ``blocks.0.mixer`` now): its checkpoints load and resume. With ``prefix``, only the
    keys of the Block there. Returns how many."""
    renamed = 0
    for key in list(state_dict):
        if prefix is not None and not key.startswith(prefix):
            continue
        new = OLD_PART.sub(lambda m: f"{m[1]}{m[2]}.{RENAMED_PARTS[m[3]]}.", key, count=1)
        if new != key:
            state_dict[new] = state_dict.pop(key)
            renamed += 1
    return renamed


def checkpoint_blocks(model: nn.Module, on: bool) -> None:
    """Activation checkpointing of every ``Block`` of ``model`` (``on``), or none: the
    models' ``activation_checkpointing`` option. Memory for activations then grows with
    one block's, not the stack's, for one more forward pass of each block."""
    if not isinstance(on, bool):
        raise TypeError(f"activation_checkpointing must be true or false, got {on!r}")
    for module in model.modules():
        if isinstance(module, Block):
            module.recompute = on


class Block(nn.Module):
    """A transformer layer: self-attention, optional cross-attention, and an MLP, each a
    residual sub-layer with its own LayerNorm, before (pre-norm) or after (post-norm).

    Args:
        d_model, n_head: width and heads of every attention.
        attention: kernel factory of the self-attention.
        cross_attention: kernel factory of the cross-attention; None for no cross-attention.
        mlp_ratio: hidden width of the MLP over d_model; 0 for no MLP sublayer at all (an
            attention-only block, Zoology's ``Identity`` state mixer).
        act: MLP activation.
        dropout: dropout on the residual branches (attention and MLP outputs).
        bias: biases in the linear layers and LayerNorms.
        norm_first: pre-norm (True) or post-norm (False, as in Vaswani et al.).
        rope_theta: RoPE in the self-attention with this base (None: none).
        alibi: ALiBi's bias on the self-attention's scores.
        keys: the config keys of the self- and cross-attention, which name a refusal of
            either (a model's ``attention``, a hybrid's layer).
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        attention: KernelFactory | str,
        cross_attention: KernelFactory | str | None = None,
        *,
        mlp_ratio: float = 4.0,
        act: str = "gelu",
        dropout: float = 0.0,
        bias: bool = True,
        norm_first: bool = True,
        rope_theta: float | None = None,
        alibi: bool = False,
        keys: tuple[str, str] = ("attention", "cross_attention"),
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        try:
            self.mixer = sequence_mixer(
                d_model, n_head, attention, bias=bias, dropout=dropout, rope_theta=rope_theta,
                alibi=alibi,
            )  # fmt: skip
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{keys[0]}: {exc}") from None
        self.norm_mixer = nn.LayerNorm(d_model, bias=bias)
        self.cross = None
        if cross_attention is not None:
            try:
                self.cross = MultiHeadAttention(
                    d_model, n_head, cross_attention, cross=True, bias=bias, dropout=dropout
                )
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"{keys[1]}: {exc}") from None
            self.norm_cross = nn.LayerNorm(d_model, bias=bias)
        if mlp_ratio < 0:
            raise ValueError(f"mlp_ratio must be a number >= 0 (0: no MLP), got {mlp_ratio}")
        self.mlp = MLP(d_model, int(mlp_ratio * d_model), act, dropout, bias) if mlp_ratio else None
        self.norm_mlp = nn.LayerNorm(d_model, bias=bias) if mlp_ratio else None

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        migrate_block_keys(state_dict, prefix)  # a checkpoint of an earlier version (attn)
        super()._load_from_state_dict(state_dict, prefix, *args)

    # activation checkpointing: the block's activations are recomputed in the backward
    # pass rather than kept (``checkpoint_blocks``)
    recompute = False

    def forward(
        self,
        x: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        memory: Context = None,
        memory_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """x (B, N, d_model); memory (B, M, d_model) or its projected (k, v) for the
        cross-attention. Masks are (B, N) and (B, M), True at padding. With ``recompute``,
        under autograd, only the block's input is kept for the backward pass, which runs
        the block again (the random state of its dropout restored: the same gradients)."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(
                self._forward, x, causal, key_padding_mask, memory, memory_padding_mask,
                use_reentrant=False,
            )  # fmt: skip
        return self._forward(x, causal, key_padding_mask, memory, memory_padding_mask)

    def _forward(
        self,
        x: Tensor,
        causal: bool,
        key_padding_mask: Tensor | None,
        memory: Context,
        memory_padding_mask: Tensor | None,
    ) -> Tensor:
        def self_attention(h: Tensor) -> Tensor:
            return self.mixer(h, causal=causal, key_padding_mask=key_padding_mask)

        x = _sublayer(x, self.norm_mixer, self_attention, self.norm_first)
        return self._cross_and_mlp(x, memory, memory_padding_mask)

    def decode(
        self,
        x: Tensor,
        state: Any = None,
        *,
        memory: Context = None,
        memory_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Any]:
        """Causal step over new tokens x (B, T, d_model) given this layer's cache ``state``."""
        new_state = None

        def self_attention(h: Tensor) -> Tensor:
            nonlocal new_state
            out, new_state = self.mixer.decode(h, state)
            return out

        x = _sublayer(x, self.norm_mixer, self_attention, self.norm_first)
        return self._cross_and_mlp(x, memory, memory_padding_mask), new_state

    def trim_state(self, state: Any, keep: int) -> Any:
        """This layer's decoding state holding at most its last ``keep`` tokens (the
        mixer's ``trim_state``); None if the mixer cannot cut it (a mixer without one)."""
        trim = getattr(self.mixer, "trim_state", None)
        return None if trim is None else trim(state, keep)

    def _cross_and_mlp(
        self, x: Tensor, memory: Context, memory_padding_mask: Tensor | None
    ) -> Tensor:
        if self.cross is not None:

            def cross_attention(h: Tensor) -> Tensor:
                return self.cross(h, memory, key_padding_mask=memory_padding_mask)

            x = _sublayer(x, self.norm_cross, cross_attention, self.norm_first)
        if self.mlp is None:
            return x
        return _sublayer(x, self.norm_mlp, self.mlp, self.norm_first)
