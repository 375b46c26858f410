"""Record what a model computes inside, and look at it through PCA.

    with FeatureRecorder(model, modules=["blocks.1.mlp"]) as rec:
        model(x)
    rec.features["blocks.1.mlp"]         # (B, N, d_model)
    rec.features["blocks.1.mixer.q"]      # (B, H, N, head_dim): q, k, v and a (the output)
    fig = plot_pca(rec.features, color=x)

``qkv=True`` (the default) adds, for every attention layer, the per-head queries, keys
and values its kernel receives and the kernel's output ``a`` (before the heads are
merged and projected), which is what the source notebooks' visualiser showed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import matplotlib
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn

from transformers_lab.attention import AttentionKernel


def _detach(value: Any) -> Tensor | None:
    if isinstance(value, tuple | list) and value and isinstance(value[0], Tensor):
        value = value[0]  # modules returning (output, state) or similar
    return value.detach().float().cpu() if isinstance(value, Tensor) else None


class FeatureRecorder:
    """Context manager recording submodule outputs, and q, k, v and attention outputs.

    Args:
        model: the network.
        modules: names of submodules (as in ``model.named_modules()``) or regular
            expressions matched against them (``re.fullmatch``) whose outputs to record.
        qkv: also record ``<layer>.q``, ``.k``, ``.v`` and ``.a`` of every attention layer
            (``<layer>`` is the attention module, e.g. ``blocks.0.mixer``).

    A module called more than once keeps its last output. Hooks go when the block exits.
    """

    def __init__(self, model: nn.Module, modules: Sequence[str] = (), qkv: bool = True) -> None:
        self.model = model
        names = dict(model.named_modules())
        self.modules: dict[str, nn.Module] = {}
        for pattern in modules:
            if pattern in names:
                self.modules[pattern] = names[pattern]
                continue
            matches = {n: m for n, m in names.items() if n and re.fullmatch(pattern, n)}
            if not matches:
                some = [n for n in names if n][:12]
                raise ValueError(
                    f"no submodule of {type(model).__name__} is named or matches {pattern!r}; "
                    f"names look like: {', '.join(some)}, ... (see model.named_modules())"
                )
            self.modules.update(matches)
        self.kernels = (
            {
                name.removesuffix(".kernel"): m
                for name, m in names.items()
                if isinstance(m, AttentionKernel)
            }
            if qkv
            else {}
        )
        if not self.modules and not self.kernels:
            raise ValueError("nothing to record: give module names or keep qkv=True")
        self.features: dict[str, Tensor] = {}
        self._handles: list[Any] = []

    def _output_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            value = _detach(output)
            if value is not None:
                self.features[name] = value

        return hook

    def _qkv_hook(self, layer: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            for key, value in zip("qkv", args[:3], strict=False):
                self.features[f"{layer}.{key}"] = value.detach().float().cpu()

        return hook

    def __enter__(self) -> FeatureRecorder:
        self.features = {}
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._output_hook(name)))
        for layer, kernel in self.kernels.items():
            self._handles.append(
                kernel.register_forward_pre_hook(self._qkv_hook(layer), with_kwargs=True)
            )
            self._handles.append(kernel.register_forward_hook(self._output_hook(f"{layer}.a")))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def as_points(feature: Tensor) -> Tensor:
    """One row per token: (B, N, C) -> (B·N, C); per-head (B, H, N, D) -> (B·N, H·D),
    the heads side by side as the output projection sees them; (B, C) stays."""
    if feature.dim() == 4:
        b, h, n, d = feature.shape
        return feature.transpose(1, 2).reshape(b * n, h * d)
    if feature.dim() == 3:
        return feature.reshape(-1, feature.shape[-1])
    if feature.dim() == 2:
        return feature
    raise ValueError(f"cannot make points of a feature of shape {tuple(feature.shape)}")


def pca(points: Tensor, k: int = 2) -> tuple[Tensor, Tensor]:
    """Project rows (M, C) on their first ``k`` principal components.

    Returns the coordinates (M, k) and the fraction of the variance each component
    explains (k,). Components are signed so that each one's largest loading is positive,
    which makes the picture stable across runs.
    """
    if points.dim() != 2 or points.shape[0] < 2:
        raise ValueError(f"pca needs at least 2 points of shape (M, C), got {tuple(points.shape)}")
    k = min(k, *points.shape)
    x = points.double() - points.double().mean(0)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    components = vh[:k]
    signs = torch.sign(components.gather(1, components.abs().argmax(1, keepdim=True)))
    components = components * signs
    variance = s**2
    explained = variance[:k] / variance.sum().clamp_min(1e-30)
    return (x @ components.T).float(), explained.float()


MAX_CLASSES = 20  # integer colours with at most this many values are classes: a legend


def point_colours(values: Tensor, points: int, name: str) -> Tensor:
    """``values`` as one colour a point: one a token as given, or one a sample (an image's
    label, a sequence's class) repeated over its tokens; one line otherwise."""
    if len(values) == points:
        return values
    if len(values) and points % len(values) == 0:
        return values.repeat_interleave(points // len(values))
    raise ValueError(
        f"plot_pca: color has {len(values)} values, but {name} has {points} points; give one "
        "value a token (B·N) or one a sample (B)"
    )


def plot_pca(
    features: dict[str, Tensor],
    names: Sequence[str] | None = None,
    color: Tensor | Sequence[float] | None = None,
    *,
    columns: int = 4,
    cell: float = 3.0,
    color_label: str = "colour",
) -> Figure:
    """One PCA scatter per feature: its first two components, one point per token,
    titled with the variance they explain. ``color`` colours the points: one value a
    token (the token ids, the positions) or one a sample (an image's label, repeated over
    its tokens). Integer values of at most 20 kinds are classes, each its own colour in a
    legend titled ``color_label``; others run along a colour bar of that label."""
    names = list(names) if names is not None else list(features)
    missing = [n for n in names if n not in features]
    if missing:
        raise ValueError(f"no recorded feature named {missing}; recorded: {list(features)}")
    if not names:
        raise ValueError("no features to plot")
    columns = max(1, min(columns, len(names)))
    rows = math.ceil(len(names) / columns)
    fig = Figure(figsize=(cell * columns, cell * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False)
    values = None if color is None else torch.as_tensor(color).reshape(-1)
    classes = None
    if values is not None and not values.is_floating_point():
        kinds = values.unique()
        classes = kinds.tolist() if len(kinds) <= MAX_CLASSES else None
    scatter = None
    for ax, name in zip(axes.flat, names, strict=False):
        coords, explained = pca(as_points(features[name]))
        if values is None:
            scatter = ax.scatter(coords[:, 0], coords[:, 1], s=6)
        elif classes is not None:
            c = point_colours(values, len(coords), name)
            cmap = matplotlib.colormaps["tab10" if len(classes) <= 10 else "tab20"]
            for i, kind in enumerate(classes):
                at = c == kind
                ax.scatter(coords[at, 0], coords[at, 1], s=6, color=cmap(i), label=str(kind))
        else:
            c = point_colours(values, len(coords), name).float().numpy()
            scatter = ax.scatter(coords[:, 0], coords[:, 1], s=6, c=c, cmap="viridis")
        ax.set_title(
            f"{name}\nPC1 {100 * explained[0]:.0f}%, PC2 {100 * explained[-1]:.0f}%", fontsize=8
        )
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    if classes is not None:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, title=color_label, loc="outside right upper", fontsize=7)
    elif values is not None and scatter is not None:
        fig.colorbar(scatter, ax=axes, shrink=0.6, label=color_label)
    return fig
