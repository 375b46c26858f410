"""Figures of the source notebooks: positional encodings, attention masks, the kernel
benchmark curves, and a grid of image predictions.

Every function returns a matplotlib ``Figure`` built without pyplot, so nothing depends
on the interactive backend: ``fig.savefig(path)`` writes it, a notebook shows it when it
is a cell's value, and ``figure_to_array`` turns it into pixels for a logger.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from transformers_lab.attention.masks import attention_mask
from transformers_lab.nn.layers import PositionalEncoding


def figure_to_array(fig: Figure, dpi: int = 100) -> np.ndarray:
    """The figure's pixels, (H, W, 3) uint8 RGB."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    fig.set_dpi(dpi)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def positional_table(kind: str, length: int, d_model: int) -> Tensor:
    """The (length, d_model) vectors that a fresh ``PositionalEncoding`` of ``kind`` adds
    (``fourier`` starts at the sinusoidal frequencies and learns them)."""
    if kind in ("learned", "none"):
        raise ValueError(
            f"{kind!r} positions have no closed form to plot; choose sinusoidal or fourier"
        )
    with torch.no_grad():
        return PositionalEncoding(kind, d_model, length).table_rows(length).detach().cpu()


def plot_positional_encoding(
    kind: str = "sinusoidal",
    length: int = 100,
    d_model: int = 64,
    dims: Sequence[int] = (0, 1, 8, 9, 32),
) -> Figure:
    """Left: a few dimensions of the encoding against position (the sine and cosine
    curves, slower for higher dimensions). Right: the whole table as a heatmap."""
    table = positional_table(kind, length, d_model).numpy()
    dims = [d for d in dims if d < d_model]
    fig = Figure(figsize=(11, 3.6))
    ax_curves, ax_table = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
    for d in dims:
        ax_curves.plot(table[:, d], label=f"dim {d}")
    ax_curves.set_xlabel("position")
    ax_curves.set_ylabel("value")
    ax_curves.set_title(f"{kind} encoding, d_model={d_model}")
    ax_curves.legend(fontsize=7, loc="lower left")
    image = ax_table.imshow(table, aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax_table.set_xlabel("dimension")
    ax_table.set_ylabel("position")
    fig.colorbar(image, ax=ax_table)
    fig.tight_layout()
    return fig


def plot_masks(
    length: int = 8, lengths: Sequence[int] = (8, 5), queries: int | None = None
) -> Figure:
    """What may attend to what (white = allowed): the causal mask, the key padding mask of
    a batch whose sequences have ``lengths`` tokens (padded to ``length``), and both.
    ``queries`` < ``length`` shows the causal mask of a decoding step (queries aligned to
    the last keys)."""
    if any(n < 1 or n > length for n in lengths):
        raise ValueError(f"every sequence length must be in 1..{length}, got {list(lengths)}")
    nq = queries or length
    padding = torch.arange(length)[None, :] >= torch.tensor(list(lengths))[:, None]  # (B, N)
    panels = [
        ("causal", attention_mask(nq, length, causal=True, key_padding_mask=None, device="cpu")),
    ]
    both = attention_mask(nq, length, causal=True, key_padding_mask=padding, device="cpu")
    pad_only = attention_mask(nq, length, causal=False, key_padding_mask=padding, device="cpu")
    for b, n in enumerate(lengths):
        panels.append((f"padding, sequence {b} ({n} tokens)", pad_only[b, 0]))
        panels.append((f"causal + padding, sequence {b}", both[b, 0]))
    fig = Figure(figsize=(2.6 * len(panels), 2.9))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, allowed) in zip(axes, panels, strict=True):
        ax.imshow(allowed.expand(nq, length).numpy(), cmap="gray", vmin=0, vmax=1)
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.tight_layout()
    return fig


def read_benchmark(path: str | Path) -> list[dict[str, Any]]:
    """Rows of ``kernels.csv`` from ``python -m transformers_lab.bench.kernels``, typed."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(
                {
                    **row,
                    "n": int(row["n"]),
                    "causal": row["causal"] in ("True", "true", "1"),
                    "time_ms": float(row["time_ms"]) if row["time_ms"] else math.nan,
                    "peak_mib": float(row["peak_mib"]) if row["peak_mib"] else math.nan,
                }
            )
    return rows


def plot_kernel_benchmark(rows: Sequence[dict[str, Any]] | str | Path) -> Figure:
    """Forward + backward time and extra peak memory against N, log-log, one colour per
    kernel variant; solid causal, dashed non-causal. ``rows`` are the benchmark's rows or
    the path of its ``kernels.csv``; rows that did not finish (status other than ok) are
    left out."""
    from matplotlib import colormaps

    if isinstance(rows, str | Path):
        rows = read_benchmark(rows)
    ok = [r for r in rows if r.get("status", "ok") == "ok" and r["time_ms"] is not None]
    ok = [r for r in ok if math.isfinite(r["time_ms"])]
    variants = list(dict.fromkeys(r["variant"] for r in ok))
    fig = Figure(figsize=(12, 4.8))
    ax_time, ax_mem = fig.subplots(1, 2)
    colours = colormaps["tab10"]
    for index, variant in enumerate(variants):
        for causal, style in ((True, "-"), (False, "--")):
            series = sorted(
                (r["n"], r["time_ms"], r["peak_mib"])
                for r in ok
                if r["variant"] == variant and r["causal"] == causal
            )
            if not series:
                continue
            label = f"{variant} ({'causal' if causal else 'non-causal'})"
            kw = {"color": colours(index % 10), "linestyle": style, "marker": "o", "label": label}
            n, t, m = zip(*series, strict=True)
            ax_time.plot(n, t, **kw)
            positive = [(x, y) for x, y in zip(n, m, strict=True) if y and y > 0]  # log axis
            if positive:
                ax_mem.plot(*zip(*positive, strict=True), **kw)
    for ax, title, ylabel in (
        (ax_time, "forward + backward time", "time (ms)"),
        (ax_mem, "extra peak memory", "memory (MiB)"),
    ):
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax_time.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def plot_predictions(
    images: Tensor,
    targets: Sequence[int],
    predictions: Sequence[int],
    class_names: Sequence[str] | None = None,
    columns: int = 8,
) -> Figure:
    """A grid of images (B, C, H, W) titled ``predicted (true)``, red where wrong."""
    if images.dim() != 4:
        raise ValueError(
            f"expected images (batch, channels, height, width), got {tuple(images.shape)}"
        )
    count = len(images)
    columns = max(1, min(columns, count))
    rows = math.ceil(count / columns)
    fig = Figure(figsize=(1.5 * columns, 1.7 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    name = (lambda i: class_names[i]) if class_names else str
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= count:
            continue
        image = images[i].detach().float().cpu()
        image = (image - image.min()) / (image.max() - image.min()).clamp_min(1e-8)
        if image.shape[0] == 1:
            ax.imshow(image[0].numpy(), cmap="gray")
        else:
            ax.imshow(image.permute(1, 2, 0).numpy())
        right = int(predictions[i]) == int(targets[i])
        ax.set_title(
            f"{name(int(predictions[i]))} ({name(int(targets[i]))})",
            fontsize=8,
            color="black" if right else "red",
        )
    fig.suptitle("predicted (true); red: wrong", fontsize=8)
    fig.tight_layout()
    return fig
