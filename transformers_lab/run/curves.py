"""Learning curves of runs from their ``metrics.csv``, following resumes.

A run resumed with ``ckpt_path=<run A>/checkpoints/last.ckpt`` writes its metrics into a
new run dir B; a sweep job resumed by ``skip_finished=true`` (or a run given its own
``hydra.run.dir``) writes them into its own dir, where the earlier part is kept as
``csv.1/`` (``csv.2/``, ...) beside ``csv/``. The curve
of B is A's rows up to the step the checkpoint was saved at, then B's: what the model
that ends in B actually went through. Rows that A logged after that checkpoint (it ran on
after the checkpoint, or was killed between two) are left out; so are the metrics of an
earlier attempt that a job started afresh in its dir (``abandoned.<n>/``)::

    tlab-summarize <run dir> --curves              # <run dir>/curves.png and curves.csv
    tlab-summarize <sweep dir> --curves --metric val/acc   # one line per job

This module reads the parts and joins them; ``summary`` draws them.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

RESUMED_AT = "resumed_at.json"  # in a set-aside csv.<k>/: the step the next part starts at


@dataclass
class Part:
    """One stretch of training: the rows of one ``metrics.csv`` and the step it began at
    (None: from its first row, or from scratch)."""

    path: Path
    rows: list[dict[str, float]]
    start: int | None


def read_rows(path: Path) -> list[dict[str, float]]:
    with path.open() as f:
        return [
            {k: float(v) for k, v in row.items() if v not in ("", None)}
            for row in csv.DictReader(f)
        ]


def resumed_from(run_dir: Path) -> Path | None:
    """The checkpoint this run was started from (its saved ``ckpt_path``), as a path that
    exists from here when it can: a relative one is taken from the run's own cwd. A run
    resumed in its own dir has its config saved again, naming its own checkpoint; its
    first part's ``ckpt_path`` is the one its set-aside metrics logged (``hparams.yaml``)."""
    config = run_dir / ".hydra" / "config.yaml"
    aside = set_aside(run_dir)
    hparams = aside[0] / "hparams.yaml" if aside else None
    logged = OmegaConf.load(hparams) if hparams is not None and hparams.is_file() else {}
    if "ckpt_path" in logged:
        ckpt = logged["ckpt_path"]
    elif config.is_file():
        ckpt = OmegaConf.load(config).get("ckpt_path")
    else:
        return None
    if not ckpt:
        return None
    path = Path(str(ckpt))
    hydra_file = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_absolute() and hydra_file.is_file():
        cwd = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.cwd", default=None)
        path = Path(cwd or ".") / path
    return path


def run_of(checkpoint: Path) -> Path | None:
    """The run dir a checkpoint was written into: the nearest parent with ``.hydra/``."""
    for parent in checkpoint.parents:
        if (parent / ".hydra").is_dir() or (parent / "result.json").is_file():
            return parent
    return None


def set_aside(run_dir: Path) -> list[Path]:
    """The ``csv.<k>`` dirs a resume in ``run_dir`` set aside, in the order k."""
    parts = (p for p in run_dir.glob("csv.*") if p.suffix[1:].isdigit())
    return sorted(parts, key=lambda p: int(p.suffix[1:]))


def retire(run_dir: Path) -> Path | None:
    """Move the metrics of an earlier attempt in ``run_dir`` (``csv/`` and any
    ``csv.<k>/``) into ``abandoned.<n>/``, kept but out of this run's curves, before a job
    starts afresh in a dir that held one (a failed job run again, other overrides, a
    stopped job without a checkpoint). Returns where they went, or None."""
    parts = [*set_aside(run_dir), *([run_dir / "csv"] if (run_dir / "csv").is_dir() else [])]
    if not parts:
        return None
    n = 1 + sum(1 for _ in run_dir.glob("abandoned.*"))
    while (run_dir / f"abandoned.{n}").exists():
        n += 1
    folder = run_dir / f"abandoned.{n}"
    folder.mkdir()
    for part in parts:
        part.rename(folder / part.name)
    return folder


def csv_parts(run_dir: Path) -> list[Part]:
    """The run's own parts in order: set-aside ``csv.<k>`` dirs, then ``csv``."""
    aside = set_aside(run_dir)
    parts: list[Part] = []
    start = None
    for folder in [*aside, run_dir / "csv"]:
        for path in sorted(folder.glob("**/metrics.csv")):
            parts.append(Part(path, read_rows(path), start))
        marker = folder / RESUMED_AT
        start = json.loads(marker.read_text()).get("step") if marker.is_file() else None
    return parts


def resume_chain(run_dir: Path) -> list[tuple[Path, Path | None]]:
    """``(run dir, checkpoint it started from)`` from the first run to ``run_dir``."""
    chain: list[tuple[Path, Path | None]] = []
    seen: set[Path] = set()
    current: Path | None = run_dir
    while current is not None and current.resolve() not in seen:
        seen.add(current.resolve())
        ckpt = resumed_from(current)
        chain.append((current, ckpt))
        current = run_of(ckpt) if ckpt is not None else None
    return chain[::-1]


def history(run_dir: str | Path) -> tuple[list[dict[str, float]], list[int]]:
    """The rows of every part of the run's training, oldest first, each part cut where
    the next one began; and the steps where a resume began."""
    # here, not at the top: a sweep's summary callback imports this module at every
    # multirun's start, and checkpoints imports Lightning (seconds a command)
    from transformers_lab.run.checkpoints import checkpoint_step

    parts: list[Part] = []
    for folder, ckpt in resume_chain(Path(run_dir)):
        own = csv_parts(folder)
        if own and ckpt is not None and own[0].start is None:
            own[0].start = checkpoint_step(ckpt)
        parts += own
    rows: list[dict[str, float]] = []
    resumes: list[int] = []
    for i, part in enumerate(parts):
        start = part.start
        if start is None and i > 0:  # no checkpoint to ask: where its own rows begin
            start = min((int(r["step"]) for r in part.rows if "step" in r), default=None)
        if start is not None and i > 0:
            rows = [r for r in rows if r.get("step", -1) < start]
            resumes.append(start)
        rows += part.rows
    return rows, resumes
