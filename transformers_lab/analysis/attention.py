"""Attention maps: capture the weights of every layer and head for one input, and draw them.

    with AttentionCapture(model) as capture:
        model(x)
    capture.maps["blocks.0.mixer"]          # (B, H, Nq, Nk), rows sum to 1
    fig = plot_attention_maps(capture.maps, task.example(batch))  # the tokens on the axes

The capture hooks the attention *kernels*: before each kernel call it reads the per-head
q and k the kernel receives and asks the kernel for ``weights(q, k, ...)``, the explicit
matrix with the same masks. So it works for every kernel, fastmax included (whose forward
never builds the matrix), and for self- and cross-attention alike. The hooks go away when
the ``with`` block ends, even on an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from transformers_lab.attention import AttentionKernel
from transformers_lab.tasks.examples import Example


@dataclass
class AttentionRecord:
    """One kernel call: the layer (the attention module's name), its weights on the CPU,
    (B, H, Nq, Nk), and whether the call was causal. A kernel that takes several keys a
    token (``keys_per_token``: Gated DeltaProduct) has a token's weights summed, one
    column a token."""

    layer: str
    weights: Tensor
    causal: bool


def _layer_name(kernel_name: str) -> str:
    """``blocks.0.mixer.kernel`` -> ``blocks.0.mixer``: maps are named after the attention
    module, which is what the model's printout shows."""
    return kernel_name.removesuffix(".kernel") or kernel_name


class AttentionCapture:
    """Context manager recording the attention weights of a model's kernel calls.

    Args:
        model: any module holding ``AttentionKernel``s (GPT, ViT, Transformer, ...).
        layers: keep only the layers whose name matches one of these regular expressions
            (``re.search``), e.g. ``["decoder.*cross"]``; None keeps all.
        max_batch: keep at most this many examples of each batch (memory: a map is
            B·H·Nq·Nk floats).

    ``records`` lists the calls in order; ``maps`` gives each layer's weights from its
    last call. A kernel that is called but never through ``forward`` (fastmax's
    recurrent ``decode``) is not seen: capture a full forward pass.
    """

    def __init__(
        self, model: nn.Module, layers: Sequence[str] | None = None, max_batch: int | None = None
    ) -> None:
        self.model = model
        self.patterns = [re.compile(p) for p in layers] if layers is not None else None
        self.max_batch = max_batch
        self.records: list[AttentionRecord] = []
        self._handles: list[Any] = []
        self.kernels = {
            _layer_name(name): module
            for name, module in model.named_modules()
            if isinstance(module, AttentionKernel) and self._wanted(_layer_name(name))
        }
        if not self.kernels:
            found = [
                _layer_name(n) for n, m in model.named_modules() if isinstance(m, AttentionKernel)
            ]
            if not found:
                raise ValueError(
                    f"{type(model).__name__} has no attention kernel to capture "
                    "(no transformers_lab.attention.AttentionKernel submodule)"
                )
            raise ValueError(f"no attention layer matches {layers}; the layers are: {found}")

    def _wanted(self, layer: str) -> bool:
        return self.patterns is None or any(p.search(layer) for p in self.patterns)

    def _hook(self, layer: str):
        def hook(kernel: AttentionKernel, args: tuple, kwargs: dict) -> None:
            q, k = args[0], args[1]
            mask = kwargs.get("key_padding_mask")
            causal = bool(kwargs.get("causal", False))
            gates = {name: kwargs[name] for name in kernel.gate_inputs if name in kwargs}
            if self.max_batch is not None:
                q, k = q[: self.max_batch], k[: self.max_batch]
                mask = None if mask is None else mask[: self.max_batch]
                gates = {name: g[: self.max_batch] for name, g in gates.items()}
            with torch.no_grad():
                weights = kernel.weights(q, k, causal=causal, key_padding_mask=mask, **gates)
            if kernel.keys_per_token > 1:  # a token's keys (Gated DeltaProduct's n_h): summed
                weights = weights.unflatten(-1, (-1, kernel.keys_per_token)).sum(-1)
            self.records.append(AttentionRecord(layer, weights.detach().float().cpu(), causal))

        return hook

    def __enter__(self) -> AttentionCapture:
        self.records = []
        for layer, kernel in self.kernels.items():
            handle = kernel.register_forward_pre_hook(self._hook(layer), with_kwargs=True)
            self._handles.append(handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the hooks (``__exit__`` does it; call it when not using ``with``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def maps(self) -> dict[str, Tensor]:
        """Layer name -> weights (B, H, Nq, Nk) of its last call, in model order."""
        last = {r.layer: r.weights for r in self.records}
        return {layer: last[layer] for layer in self.kernels if layer in last}


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode without gradients inside the block; its train/eval mode
    is restored after it, also on an error."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def attention_maps(model: nn.Module, *inputs: Any, **kwargs: Any) -> dict[str, Tensor]:
    """Run ``model(*inputs)`` in eval mode and return its attention maps (see
    ``AttentionCapture``; ``kwargs`` go to it). The model's train/eval mode is restored."""
    with evaluating(model), AttentionCapture(model, **kwargs) as capture:
        model(*inputs)
    return capture.maps


# tick labels are set in 6 pt type, at least this far apart (in points) to stay readable
LABEL_PITCH = 8


def readable_ticks(n: int, length: float, max_labels: int | None = None) -> range:
    """The positions of ``n`` that get a label on an axis ``length`` points long: every
    one where they fit ``LABEL_PITCH`` apart (or ``max_labels`` of them), else every k-th
    from the first, k as small as fits."""
    room = max(1, max_labels if max_labels is not None else int(length // LABEL_PITCH))
    return range(0, n, math.ceil(n / room))


def plot_attention(
    weights: Tensor,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    *,
    ax: Any = None,
    title: str = "",
    max_labels: int | None = None,
) -> Any:
    """Heatmap of one map (Nq, Nk): queries down, keys across, colour from 0 to the
    largest weight of the map, read on its colour bar. ``queries`` and ``keys`` (the
    tokens) label the ticks: all of them where they fit the axis, else an evenly spaced
    subset (``readable_ticks``; ``max_labels`` caps their number). Returns the Axes."""
    from matplotlib.figure import Figure

    if weights.dim() != 2:
        raise ValueError(f"plot_attention takes one (Nq, Nk) map, got shape {tuple(weights.shape)}")
    if ax is None:
        ax = Figure(figsize=(4, 4)).subplots()
    w = weights.detach().float().cpu().numpy()
    image = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=max(float(w.max()), 1e-12), aspect="auto")
    bar = ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.03)  # each map its own scale
    bar.ax.tick_params(labelsize=6)
    bar.set_label("weight", fontsize=7)
    box = ax.get_window_extent()  # in pixels, as the figure lays the axes out now
    points = 72 / ax.figure.dpi
    for labels, axis, n, length, rotation in (
        (queries, ax.yaxis, w.shape[0], box.height * points, 0),
        (keys, ax.xaxis, w.shape[1], box.width * points, 90),
    ):
        if labels is None or len(labels) != n:
            axis.set_ticks([])
            continue
        shown = readable_ticks(n, length, max_labels)
        axis.set_ticks(shown, [labels[i] for i in shown], fontsize=6, rotation=rotation)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title, fontsize=8)
    return ax


def plot_attention_maps(
    maps: dict[str, Tensor],
    example: Example | None = None,
    *,
    index: int = 0,
    heads: Sequence[int] | None = None,
    max_heads: int = 8,
    cell: float = 2.6,
    title: str = "",
) -> Any:
    """A grid of maps: one row per layer, one column per head, for example ``index`` of
    the batch. ``example`` names the axes. Returns a matplotlib ``Figure`` (not tied to
    pyplot: save it with ``fig.savefig``; a notebook shows it when it is a cell's value)."""
    from matplotlib.figure import Figure

    if not maps:
        raise ValueError("no attention maps to plot (did the model run inside the capture?)")
    n_head = max(w.shape[1] for w in maps.values())
    heads = list(heads) if heads is not None else list(range(min(n_head, max_heads)))
    fig = Figure(figsize=(cell * len(heads) + 0.5, cell * len(maps) + 0.6))
    axes = fig.subplots(len(maps), len(heads), squeeze=False)
    for row, (layer, weights) in enumerate(maps.items()):
        nq, nk = weights.shape[-2:]
        queries, keys = example.axis_labels(layer, nq, nk) if example else (None, None)
        for col, head in enumerate(heads):
            ax = axes[row][col]
            if head >= weights.shape[1]:
                ax.axis("off")
                continue
            plot_attention(weights[index, head], queries, keys, ax=ax, title=f"{layer} h{head}")
            if col:
                ax.set_ylabel("")
            if row < len(maps) - 1:
                ax.set_xlabel("")
    if title or (example and example.caption):
        fig.suptitle(title or example.caption, fontsize=9)
    fig.tight_layout()
    return fig
