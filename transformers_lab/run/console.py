"""What the entry points share about a run: its CPU threads, restoring one from its
checkpoint, the lines it prints, the final test, and closing its loggers. No entry point
imports another; they all import this."""

from __future__ import annotations

import logging
import sys
from typing import Any

from lightning.pytorch.utilities import rank_zero_only

log = logging.getLogger(__name__)


def metrics_dict(metrics: dict[str, Any]) -> dict[str, float]:
    """Tensor metrics as plain floats, sorted by name."""
    return {k: float(v) for k, v in sorted(metrics.items())}


def say(*lines: str, file: Any = None) -> None:
    """Print on the first process only (under DDP every process runs this script)."""
    if rank_zero_only.rank == 0:
        print(*lines, sep="\n", file=file or sys.stdout, flush=True)


def print_metrics(metrics: dict[str, float]) -> None:
    """The run's last lines: its final metrics, one per line."""
    say("final metrics:", *(f"  {name}: {value:.6g}" for name, value in metrics.items()))


def report(metrics: dict[str, float], checkpoints: dict[str, str | None]) -> None:
    print_metrics(metrics)
    say(f"best checkpoint: {checkpoints['best']}", f"last checkpoint: {checkpoints['last']}")
