"""Pieces the models share: layer stacks, cache reordering, token sampling."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from transformers_lab.errors import at_least, check_sampling
from transformers_lab.nn import Block, KernelFactory
from transformers_lab.nn.multihead import (
    head_size,
    refuse_causal,
    refuse_noncausal,
    refuse_short_positions,
)
from transformers_lab.nn.parts import ShortConvolution

Hybrid = Sequence[Any] | Mapping[int, Any] | None


def layer_choices(n_layer: int, attention: Any, hybrid: Hybrid) -> list[Any]:
    """Each layer's attention config (a kernel factory or name, or a mixer's factory).

    ``hybrid`` (``model.hybrid``): None: ``attention`` everywhere; a list: a pattern that
    repeats over the layers, whose length divides n_layer (``[base_conv, based]``:
    Zoology's alternation); a mapping {layer: choice}: those layers changed, the others
    ``attention``. The choice ``"attention"`` is the model's ``attention``."""
    if hybrid is None:
        return [attention] * n_layer
    if isinstance(hybrid, Mapping):
        for index in hybrid:
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_layer:
                raise ValueError(
                    f"model.hybrid names layer {index!r}, but the model's layers are 0.."
                    f"{n_layer - 1} (n_layer={n_layer})"
                )
        chosen = [hybrid.get(i, "attention") for i in range(n_layer)]
    else:
        pattern = list(hybrid)
        if not pattern or n_layer % len(pattern):
            raise ValueError(
                f"model.hybrid has {len(pattern)} entries, which does not divide "
                f"n_layer={n_layer}: give one per layer, or a pattern whose length divides "
                "n_layer (it repeats), or {layer: choice} for some layers"
            )
        chosen = [pattern[i % len(pattern)] for i in range(n_layer)]
    return [attention if c == "attention" else c for c in chosen]


def layer_name(choice: Any) -> str:
    """A layer's choice, named for messages and records: its kernel or mixer name."""
    if isinstance(choice, str):
        return choice
    func = getattr(choice, "func", choice)
    return getattr(func, "name", getattr(func, "__name__", type(choice).__name__))


def layer_names(model: nn.Module) -> list[str] | None:
    """Each layer's mixer as built, in order: its kernel's name, the options that tell its
    settings apart (``labelled``) and the parts switched on (``fastmax(p=1, short_conv=4)``),
    or a mixer's name (``base_conv``); None for a model without blocks."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return None
    names = []
    for block in blocks:
        mixer = block.mixer
        kernel = getattr(mixer, "kernel", None)
        if kernel is None:
            names.append(getattr(mixer, "name", type(mixer).__name__))
            continue
        options = [f"{key}={getattr(kernel, key)}" for key in kernel.labelled]
        options += mixer.parts.switched_on()
        names.append(f"{kernel.name}({', '.join(options)})" if options else kernel.name)
    return names


def flops_per_token(model: nn.Module, blocks: Sequence[nn.Module], n: int) -> float:
    """Floating-point operations of one forward and backward pass a token, in windows of
    ``n`` tokens: 6 a weight of every linear layer a token passes through (2 forward, 4
    backward; the LM head's tied weight counted once, as a product), and each layer's
    mixer's own count over the window (its kernel's ``flops``: softmax's grows with n, a
    linear kernel's does not), shared by its tokens. Embedding lookups, norms and
    elementwise work are not counted: the convention of PaLM's model FLOPs, which
    nanoGPT's MFU follows."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    mixing = sum(mixer_flops(block.mixer, n) for block in blocks)
    return 6 * weights + mixing / n


def mixer_flops(mixer: nn.Module, n: int) -> int:
    """A mixer's own FLOPs over a window of ``n`` tokens, forward and backward: its
    attention kernel's count, causal; its short convolutions' depthwise products, 6 K a
    channel and token. A mixer of the user's without a kernel counts its linear layers
    only."""
    kernel = getattr(mixer, "kernel", None)
    total = kernel.flops(n, causal=True) if callable(getattr(kernel, "flops", None)) else 0
    for conv in (m for m in mixer.modules() if isinstance(m, ShortConvolution)):
        total += 6 * conv.weight.numel() * n
    return total


def check_sizes(dropout: float, **counts: int) -> None:
    """A model's shared options: its ``counts`` (layers, heads, width) at least 1 and a
    dropout probability below 1 (the MLP's ratio is ``nn.Block``'s). Each model calls it
    first, with its own names for them."""
    at_least(1, **counts)
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")


def block_stack(
    n_layer: int,
    d_model: int,
    n_head: int,
    attention: KernelFactory | str,
    cross_attention: KernelFactory | str | None = None,
    hybrid: Hybrid = None,
    *,
    who: str,
    causal: bool,
    context: int | None,
    cross_key: str = "cross_attention",
    **block_options: Any,
) -> nn.ModuleList:
    """``n_layer`` Blocks with the same options; ``hybrid`` chooses each one's attention
    (``layer_choices``).

    Each layer is held to the rules of the model that calls it, ``who``: its kernel
    attends ``causal``-ly (or both ways) and weighs positions up to ``context`` at least.
    A refusal names the config key the layer came from: ``attention``, ``model.hybrid,
    layer i (name)``, or ``cross_key`` for a cross-attention."""
    head_size(d_model, n_head)
    blocks = []
    for i, choice in enumerate(layer_choices(n_layer, attention, hybrid)):
        key = "attention" if hybrid is None else f"model.hybrid, layer {i} ({layer_name(choice)})"
        keys = (key, cross_key)
        block = Block(d_model, n_head, choice, cross_attention, keys=keys, **block_options)
        try:
            (refuse_causal if causal else refuse_noncausal)([block.mixer], who)
            refuse_short_positions([block.mixer], context, who)
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
        blocks.append(block)
    return nn.ModuleList(blocks)


def final_norm(d_model: int, bias: bool, norm_first: bool) -> nn.Module:
    """The LayerNorm after a pre-norm stack; post-norm stacks end normalised already."""
    return nn.LayerNorm(d_model, bias=bias) if norm_first else nn.Identity()


def reorder_cache(state: Any, index: Tensor) -> Any:
    """Select batch rows ``index`` of every tensor in a (nested) decoding cache."""
    if state is None:
        return None
    if isinstance(state, Tensor):
        return state.index_select(0, index)
    if not isinstance(state, (tuple, list)):  # a count (RoPE's position), the same for all
        return state
    items = (reorder_cache(s, index) for s in state)
    return type(state)(*items) if hasattr(state, "_fields") else type(state)(items)


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V).

    ``temperature=0`` is greedy. ``top_k`` keeps the k most likely tokens and ``top_p``
    the smallest set whose probability reaches p (nucleus sampling); both can be combined.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
