"""A checkpoint scored at other lengths than the one it was trained at (``eval_lengths``),
its needles at several depths (``eval_depths``), and a language model's loss by position
(``loss_by_position``): ``tlab-eval``'s and a training run's evaluation past the trained
length.

At each length the data is rebuilt from the checkpoint's data config with ``block_size``
set to that length, MQAR's key-value pairs scaled with it (the pairs per token the model
was trained at: 64x4, 128x8, 256x16, as Zoology's test sets grow), and the model is
rebuilt at that context with the checkpoint's weights. Nothing in a GPT's weights depends
on its context but a learned positions table: ``GPT.reach`` refuses a length past its end,
or past a cosFormer's max_len, before anything is scored. Softmax sees its whole context
at each length; the linear and gated kernels run their recurrence over it. The lengths
are checked before a run trains (``run.components.plan``, by the preflight), and the
loss by position is ``analysis.positions``'.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig, OmegaConf

from transformers_lab.analysis.positions import position_losses
from transformers_lab.files import atomic_write
from transformers_lab.run.checkpoints import SavedCheckpoint, read_checkpoint
from transformers_lab.run.components import build_on_meta, check_split, plan, restore
from transformers_lab.run.record import say
from transformers_lab.run.trainer import build_trainer
from transformers_lab.run.values import LengthOptions

Trainer = Callable[[], L.Trainer]


def suffix(length: int, depth: float | None) -> str:
    """How a metric at ``length`` (and ``depth``) is named: ``val/acc@256``,
    ``val/acc@256:d0.5``."""
    return f"@{length}" if depth is None else f"@{length}:d{depth:g}"


def evaluate_lengths(
    checkpoint: SavedCheckpoint,
    options: LengthOptions,
    trainer: Trainer,
    data: Any = None,
    split: str = "val",
) -> tuple[dict[str, float], list[dict[str, Any]], int]:
    """The checkpoint's metrics on ``split`` at each of the ``options``' lengths (and each
    needle depth), named by ``suffix``; with buckets, its loss by position at each length
    (``position_losses``' rows); and the length it was trained at. ``data`` overrides
    entries of the saved data config. Every length is checked, model (on the meta
    device) and data, before the first is scored; the checkpoint, read once, gives its
    weights to each."""
    run = checkpoint.run_config(data)
    check_split(run.data, split)
    model = build_on_meta(run)  # None: a model of the user's that only its data can size
    saved = OmegaConf.to_container(run.data, resolve=True)
    settings = plan(model, saved, options.lengths, options.depths, str(checkpoint.path))
    trained = model.block_size
    metrics: dict[str, float] = {}
    positions: list[dict[str, Any]] = []
    for (n, d), overrides in settings.items():
        scorer = trainer()
        score = scorer.validate if split == "val" else scorer.test
        context = {"block_size": max(n, trained)}  # a learned table keeps its size
        at = restore(checkpoint, OmegaConf.merge(run, {"data": overrides, "model": context}))
        results = score(at.task, datamodule=at.datamodule, verbose=False)
        for key, value in (results[0] if results else {}).items():
            metrics[f"{key}{suffix(n, d)}"] = float(value)
        if options.buckets and d is None:
            positions += position_losses(at.task.model, at.datamodule, options.buckets, split)
    return metrics, positions, trained


def score_lengths(
    cfg: DictConfig,
    options: LengthOptions,
    saved: dict[str, str | None],
    resumed: SavedCheckpoint | None = None,
) -> dict[str, float]:
    """A training run's evaluation step: its best checkpoint (else its last, else the one
    it ``resumed``: ``saved`` names the run's) scored at the ``options``' lengths (and
    depths) on the validation split, with its trainer's accelerator and precision on one
    device (the first process of a DDP run scores, the others do not); the metrics, also
    in ``lengths.csv`` in the run dir. The checkpoint is read once, or not at all where
    it is the one resumed."""
    scored = saved["best"] or saved["last"]
    if scored is None and resumed is None:
        say("eval_lengths: the run saved no checkpoint to score at other lengths")
        return {}
    given = resumed is not None and (scored is None or Path(scored) == resumed.path)
    trust = bool(cfg.get("trust_checkpoint"))
    checkpoint = resumed if given else read_checkpoint(scored, trust)
    one = {"devices": 1, "num_nodes": 1, "strategy": "auto"}  # after a DDP fit: one process
    metrics, _, _ = evaluate_lengths(
        checkpoint,
        options._replace(buckets=None),
        lambda: build_trainer(cfg, purpose="score", **one),
    )
    write_lengths(metrics, Path(cfg.paths.output_dir))
    return metrics


def write_lengths(metrics: dict[str, float], out: Path) -> Path:
    """``lengths.csv``: one row per (metric, length, depth) of ``evaluate_lengths``."""
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(["metric", "length", "depth", "value"])
    for key, value in metrics.items():
        name, _, where = key.rpartition("@")
        length, _, depth = where.partition(":d")
        writer.writerow([name, length, depth, f"{value:.6g}"])
    atomic_write(out / "lengths.csv", table.getvalue())
    return out / "lengths.csv"
