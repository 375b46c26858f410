"""What a task hands out for inspection, one input of a batch with the labels of its
positions (``Example``), and what a task may ask of the model it trains beyond a forward
pass (``Generating``, ``PatchLayout``): checked with ``isinstance``, never probed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

Detokenizer = Callable[[Sequence[int]], str]  # token ids -> text


@runtime_checkable
class Generating(Protocol):
    """A model that continues a prompt of token ids (a language model's samples)."""

    def generate(self, idx: Tensor, max_new_tokens: int, **sampling: Any) -> Tensor: ...


@runtime_checkable
class TokenScorer(Protocol):
    """A language model whose logits can be taken at chosen positions only: hidden
    states first (``features``), then ``logits`` of the ones that are scored."""

    def features(self, idx: Tensor) -> Tensor: ...

    def logits(self, h: Tensor) -> Tensor: ...


@runtime_checkable
class PatchLayout(Protocol):
    """A model that cuts an image into patches: how many, and how many tokens (a class
    token) come before them."""

    @property
    def num_patches(self) -> int | None: ...

    @property
    def num_prefix_tokens(self) -> int: ...


@dataclass
class Example:
    """One input ready for inspection: ``model(*inputs)`` runs it (batch of one), and the
    labels name its positions for the axes of a map: ``tokens`` for a decoder-only or
    encoder-only model, ``source``/``target`` for an encoder-decoder. ``image`` is the
    input image (C, H, W) when there is one; ``caption`` says what the example is."""

    inputs: tuple[Tensor, ...]
    tokens: list[str] | None = None
    source: list[str] | None = None
    target: list[str] | None = None
    image: Tensor | None = None
    caption: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def axis_labels(self, layer: str, nq: int, nk: int) -> tuple[list[str] | None, ...]:
        """(query labels, key labels) of a layer's map: encoder layers attend over the
        source, decoder self-attention over the target, cross-attention from the target
        to the source. Labels that do not match the map's size are dropped."""
        if "cross" in layer:
            queries, keys = self.target, self.source
        elif "decoder" in layer:
            queries = keys = self.target
        elif "encoder" in layer and self.source is not None:
            queries = keys = self.source
        else:
            queries = keys = self.tokens
        return (
            queries if queries is not None and len(queries) == nq else None,
            keys if keys is not None and len(keys) == nk else None,
        )


def token_labels(ids: Sequence[int], detokenize: Detokenizer | None = None) -> list[str]:
    """Printable labels of token ids: each detokenized alone when ``detokenize`` is given,
    with whitespace made visible; the id otherwise (or when it gives nothing)."""
    labels = []
    for i in ids:
        text = detokenize([int(i)]) if detokenize is not None else ""
        text = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423")
        labels.append(text if text else str(int(i)))
    return labels


def patch_labels(num_patches: int, num_tokens: int) -> list[str]:
    """Labels of a ViT's tokens: ``cls`` for the extra leading ones, then ``p0, p1, ...``."""
    extra = num_tokens - num_patches
    return ["cls"] * extra + [f"p{i}" for i in range(num_patches)]
