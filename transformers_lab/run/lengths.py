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
at each length; the linear and gated kernels run their recurrence over it.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from transformers_lab.data.base import IGNORE
from transformers_lab.errors import ConfigError
from transformers_lab.files import atomic_write
from transformers_lab.run.checkpoints import SavedCheckpoint, read_checkpoint, restore
from transformers_lab.run.components import build_datamodule, build_on_meta, check_split
from transformers_lab.run.record import say
from transformers_lab.run.trainer import build_trainer

Trainer = Callable[[], L.Trainer]
LENGTH_KEYS = ("eval_lengths", "eval_depths", "loss_by_position")


class LengthOptions(NamedTuple):
    """What a run or ``tlab-eval`` scores past the trained length, parsed once
    (``length_options``): the lengths, the needle depths at each, and the buckets of the
    loss by position (None: not asked)."""

    lengths: list[int]
    depths: list[float] | None = None
    buckets: int | None = None


def length_options(cfg: DictConfig) -> LengthOptions | None:
    """``eval_lengths``, ``eval_depths`` and ``loss_by_position`` of ``cfg`` checked and
    parsed (None where none is given), else one line that says what to give."""
    given = [key for key in LENGTH_KEYS if cfg.get(key) is not None]
    if not given:
        return None
    if cfg.get("eval_lengths") is None:
        raise ConfigError(
            f"{given[0]} needs eval_lengths, the lengths to score at, e.g. eval_lengths=[256,512]"
        )
    depths = check_depths(cfg.eval_depths) if cfg.get("eval_depths") is not None else None
    buckets = cfg.get("loss_by_position")
    if buckets is not None and not (isinstance(buckets, int) and buckets >= 1):
        raise ConfigError(f"loss_by_position={buckets!r}: give a number of buckets >= 1, e.g. 16")
    return LengthOptions(check_lengths(cfg.eval_lengths), depths, buckets)


def is_list(value: Any) -> bool:
    """A list from the command line (a ListConfig) or from Python."""
    return OmegaConf.is_list(value) or isinstance(value, list | tuple)


def check_lengths(lengths: Any, key: str = "eval_lengths") -> list[int]:
    """``lengths`` as a list of positive ints, else one line that says what to give."""
    values = list(lengths) if is_list(lengths) else []
    if not values or not all(isinstance(n, int) and not isinstance(n, bool) for n in values):
        raise ConfigError(
            f"{key}={lengths!r} is not a list of lengths; give positive ints, e.g. "
            f"{key}=[64,128,256,512]"
        )
    if min(values) < 1:
        raise ConfigError(f"{key}: a length must be >= 1, got {min(values)}")
    return values


def check_depths(depths: Any) -> list[float]:
    """``eval_depths`` as a list of numbers in [0, 1], else one line."""
    values = list(depths) if is_list(depths) else []
    if not values or not all(
        isinstance(d, int | float) and not isinstance(d, bool) and 0 <= d <= 1 for d in values
    ):
        raise ConfigError(
            f"eval_depths={depths!r}: each depth must be in [0, 1] (0: the haystack's start, "
            "1: its end), e.g. eval_depths=[0,0.25,0.5,0.75,1]"
        )
    return [float(d) for d in values]


def at_length(data: dict[str, Any], trained: int, length: int) -> dict[str, Any]:
    """The data config's entries at ``length``: its context, and MQAR's key-value pairs
    scaled with it (as many per token as at the ``trained`` length)."""
    out: dict[str, Any] = {"block_size": length}
    if data.get("problem") == "mqar" and data.get("num_kv_pairs"):
        out["num_kv_pairs"] = max(1, data["num_kv_pairs"] * length // trained)
    return out


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
        run = restore(checkpoint, {**(data or {}), **overrides}, model=context)
        results = score(run.task, datamodule=run.datamodule, verbose=False)
        for key, value in (results[0] if results else {}).items():
            metrics[f"{key}{suffix(n, d)}"] = float(value)
        if options.buckets and d is None:
            positions += position_losses(run.task.model, run.datamodule, options.buckets, split)
    return metrics, positions, trained


def plan(
    model: Any,
    data: dict[str, Any],
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    what: str = "the model",
) -> dict[tuple[int, float | None], dict[str, Any]]:
    """The data config's entries at each (length, depth) to score ``model`` (trained on
    ``data``) at, every one checked first: the model reaches the length (``reach``), the
    data is built there, and depths are asked of needle data only. ``what`` names the
    model in a refusal (the checkpoint)."""
    if not callable(getattr(model, "reach", None)):
        kind = "model sized by its data" if model is None else type(model).__name__
        raise ConfigError(
            f"evaluation at other lengths scores a GPT (language model, MQAR, needles); "
            f"{what} is a {kind}"
        )
    if "block_size" not in data:
        raise ConfigError(
            f"evaluation at other lengths needs data of sequences with a block_size; "
            f"{data.get('_target_', '?')} has none"
        )
    if depths is not None and "depth" not in data:
        raise ConfigError(
            "eval_depths sweeps a needle's depth, but the data has none (it is no needle "
            "task: data=passkey, needle_text or needle_multikey); drop eval_depths"
        )
    settings = {}
    for n, d in [(n, d) for n in lengths for d in (depths or [None])]:
        reason = model.reach(n)
        if reason:
            raise ConfigError(f"cannot evaluate {what} at length {n}: {reason}")
        settings[n, d] = at_length(data, data["block_size"], n)
        if d is not None:
            settings[n, d]["depth"] = d
        config = OmegaConf.create({**data, **settings[n, d]})
        build_datamodule(config, setup=False, where=f"at length {n}: ")
    return settings


def check_length_options(options: LengthOptions, cfg: DictConfig, model: Any) -> None:
    """A run's lengths and depths, refused before it trains (``model``: the run built on
    the meta device, None where the config has no model)."""
    if model is not None and cfg.get("data") is not None:
        data = OmegaConf.to_container(cfg.data, resolve=True)
        plan(model, data, options.lengths, options.depths)


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


def write_position_losses(rows: Sequence[dict[str, Any]], trained: int, out: Path) -> Path:
    """``loss_by_position.csv`` and ``loss_by_position.png``: a line per evaluated
    length, the trained length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=["length", "start", "end", "loss", "tokens"])
    writer.writeheader()
    writer.writerows({**r, "loss": "" if r["loss"] is None else f"{r['loss']:.6g}"} for r in rows)
    atomic_write(out / "loss_by_position.csv", table.getvalue())
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
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
    plt.close(fig)
    return out / "loss_by_position.png"
