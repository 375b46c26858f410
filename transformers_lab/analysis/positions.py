"""A language model's next-token loss by position (``position_losses``), as long-context
papers show a model past its trained length, and its table and figure
(``write_position_losses``); ``tlab-eval ... loss_by_position=16`` at each evaluated
length (``run.lengths``)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from transformers_lab.data.base import IGNORE
from transformers_lab.files import atomic_write


@torch.no_grad()
def position_losses(
    model: torch.nn.Module, datamodule: Any, buckets: int, split: str = "val"
) -> list[dict[str, Any]]:
    """The model's next-token loss on ``split`` by position: the sequence cut into
    ``buckets`` equal spans, the mean loss of the supervised tokens in each (None where
    none is supervised). How long-context papers show a model past its trained length."""
    loader = datamodule.val_dataloader() if split == "val" else datamodule.test_dataloader()
    model.eval()  # no dropout in a score
    sums = counts = None
    for x, y in loader:
        logits = model(x)
        losses = F.cross_entropy(
            logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE, reduction="none"
        ).view_as(y)
        supervised = y != IGNORE
        if sums is None:
            sums = torch.zeros(y.shape[1], dtype=torch.float64)
            counts = torch.zeros(y.shape[1], dtype=torch.long)
        sums += (losses * supervised).sum(0).double()
        counts += supervised.sum(0)
    if sums is None:
        return []
    length = len(sums)
    edges = [round(i * length / buckets) for i in range(min(buckets, length) + 1)]
    rows = []
    for start, end in zip(edges, edges[1:], strict=False):
        tokens = int(counts[start:end].sum())
        loss = float(sums[start:end].sum() / tokens) if tokens else None
        rows.append({"length": length, "start": start, "end": end, "loss": loss, "tokens": tokens})
    return rows


def write_position_losses(rows: Sequence[dict[str, Any]], trained: int, out: Path) -> Path:
    """``loss_by_position.csv`` and ``loss_by_position.png`` in ``out``: a line per
    evaluated length, the trained length marked."""
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=["length", "start", "end", "loss", "tokens"])
    writer.writeheader()
    writer.writerows({**r, "loss": "" if r["loss"] is None else f"{r['loss']:.6g}"} for r in rows)
    atomic_write(out / "loss_by_position.csv", table.getvalue())
    fig = Figure(figsize=(6, 3.6), dpi=120)
    ax = fig.subplots()
    for length in sorted({r["length"] for r in rows}):
        points = [r for r in rows if r["length"] == length and r["loss"] is not None]
        middle = [(r["start"] + r["end"] - 1) / 2 for r in points]
        ax.plot(middle, [r["loss"] for r in points], "o-", markersize=3, label=f"length {length}")
    ax.axvline(trained - 0.5, color="grey", linestyle=":", label=f"trained at {trained}")
    ax.set_xlabel("position")
    ax.set_ylabel("next-token loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(out / "loss_by_position.png", lambda f: fig.savefig(f, format="png"))
    return out / "loss_by_position.png"
