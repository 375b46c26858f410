"""The job record: what a run of ``tlab-train`` leaves in ``<run dir>/result.json``.

It says ``running`` from the job's start, so a job killed outright is known as such, and
is rewritten once the job ends: ``ok`` with its metrics, ``pruned`` (an Optuna trial its
study stopped early) with the metrics it reached, ``failed`` with its error, or
``interrupted`` with the checkpoint it saved. The summary reads nothing else. Beside it,
what a run prints (``say``: on the first process only; its final metrics) and its stop by
a signal (``Interrupted``), which the job records.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only  # no torch: the summary's

from transformers_lab.errors import RunStopped
from transformers_lab.files import atomic_write

RESULT_FILE = "result.json"

STATUSES = ("ok", "pruned", "failed", "interrupted", "incomplete")  # incomplete: running, or killed


@dataclass
class Monitor:
    """The metric the job's checkpoints and its sweeper follow, and its best value."""

    metric: str | None = None
    mode: str = "min"
    best: float | None = None


@dataclass
class Outcome:
    """What a finished fit reports to its job."""

    metrics: dict[str, float]  # final metrics: validation, then test
    best: float | None  # the monitored metric's best value (the best checkpoint's score)
    params: int
    checkpoints: dict[str, str | None]  # best and last
    state_size: int | None = None  # the numbers its attention holds of a whole context
    pruned_at: int | None = None  # the global step an Optuna pruner stopped it at
    seeded: dict[str, Any] | None = None  # what the seed fixed (``run.fit.seeded``)
    layers: list[str] | None = None  # each layer's mixer: kernel and parts (``Task.layers``)


@dataclass
class JobRecord:
    """One job: its overrides, how it ended, and what it measured."""

    status: str = "running"  # running, ok, pruned, failed, interrupted
    overrides: list[str] = field(default_factory=list)
    run_dir: str = ""
    monitor: Monitor = field(default_factory=Monitor)
    metrics: dict[str, float] = field(default_factory=dict)
    objective: float | None = None  # the monitored metric's final value, for the sweeper
    params: int | None = None
    state_size: int | None = None
    checkpoints: dict[str, str | None] = field(default_factory=dict)
    time_s: float | None = None
    error: str | None = None
    trial: int | None = None  # its Optuna trial's number (a study sweeper's job)
    pruned_at: int | None = None  # the global step its trial was pruned at
    seeded: dict[str, Any] | None = None  # what its seed fixed: data, rng, initial params
    layers: list[str] | None = None  # each layer's mixer, as built (a hybrid's schedule)

    def finished(self, outcome: Outcome) -> None:
        """Fill in a fit's outcome: status ``ok``, or ``pruned`` if its trial was."""
        self.status, self.error = ("ok" if outcome.pruned_at is None else "pruned"), None
        self.pruned_at = outcome.pruned_at
        self.metrics, self.params = dict(outcome.metrics), outcome.params
        self.state_size, self.checkpoints = outcome.state_size, dict(outcome.checkpoints)
        self.seeded, self.layers = outcome.seeded, outcome.layers
        self.monitor.best = outcome.best
        self.objective = self.metrics.get(self.monitor.metric or "")

    def best_of(self, metric: str) -> float | None:
        """The best value of ``metric`` if it is the monitored one."""
        return self.monitor.best if self.monitor.metric == metric else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        """A record from its JSON form; keys it does not know are left out, keys it lacks
        take their defaults (records of older versions read too)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        monitor = values.get("monitor") or {}
        keys = ("metric", "mode", "best")
        values["monitor"] = Monitor(**{k: v for k, v in monitor.items() if k in keys})
        for name in ("overrides", "metrics", "checkpoints"):
            if values.get(name) is None:
                values.pop(name, None)
        return cls(**values)


def write_record(run_dir: str | Path, record: JobRecord) -> Path:
    """Save a job's record as ``<run_dir>/result.json``, atomically."""
    text = json.dumps(record.to_dict(), indent=2, sort_keys=True, default=str) + "\n"
    return atomic_write(Path(run_dir) / RESULT_FILE, text)


def read_record(run_dir: str | Path) -> JobRecord | None:
    """A job's record, or None if it has none (or an unreadable one)."""
    try:
        data = json.loads((Path(run_dir) / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return JobRecord.from_dict(data) if isinstance(data, dict) else None


class Interrupted(RunStopped):
    """SIGTERM or SIGINT stopped the run after saving a checkpoint (``checkpoint``); the
    best checkpoint so far and its score are ``best`` and ``best_score``."""

    def __init__(
        self,
        message: str,
        signal_name: str,
        checkpoint: str | None,
        best: str | None = None,
        best_score: float | None = None,
    ) -> None:
        super().__init__(message)
        self.signal_name, self.checkpoint = signal_name, checkpoint
        self.best, self.best_score = best, best_score
        self.exit_code = 128 + getattr(signal, signal_name)  # the shell's convention


def metrics_dict(metrics: dict[str, Any]) -> dict[str, float]:
    """Tensor metrics as plain floats, sorted by name."""
    return {k: float(v) for k, v in sorted(metrics.items())}


def first_process() -> bool:
    """Whether this is the first process of a run: by the rank Lightning set, or before
    Lightning is loaded, by the launcher's (under DDP every process runs the script)."""
    rank = getattr(rank_zero_only, "rank", None)
    if rank is None:
        ranks = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
        rank = next((int(os.environ[k]) for k in ranks if os.environ.get(k)), 0)
    return rank == 0


def say(*lines: str, file: Any = None) -> None:
    """Print on the first process only."""
    if first_process():
        print(*lines, sep="\n", file=file or sys.stdout, flush=True)


def print_metrics(metrics: dict[str, float]) -> None:
    """The run's last lines: its final metrics, one per line."""
    say("final metrics:", *(f"  {name}: {value:.6g}" for name, value in metrics.items()))


def state_size(model: Any) -> int | None:
    """The numbers a model's attention holds of a whole context (``state_size()`` of GPT
    and EncoderClassifier, or of a model of the user's that takes no argument), else None."""
    size = getattr(model, "state_size", None)
    try:
        return int(size()) if callable(size) else None
    except TypeError:  # a method of another meaning, that needs arguments
        return None


def outcome(fitted: Any, parts: Any) -> Outcome:
    """A fit's ``Outcome``, its last lines printed: the final metrics and checkpoints of
    ``fitted`` (``run.fit.Fitted``), the size of the model ``parts`` built and what its
    seed fixed (``run.components.Components``)."""
    print_metrics(fitted.metrics)
    say(f"best checkpoint: {fitted.checkpoints['best']}")
    say(f"last checkpoint: {fitted.checkpoints['last']}")
    return Outcome(
        **fitted._asdict(),
        params=parts.task.num_params,
        state_size=state_size(parts.model),
        seeded=parts.seeded,
        layers=parts.task.layers,
    )
