"""The job wrapper every ``tlab-train`` run goes through: it records the job in
``<run dir>/result.json`` from start to end, keeps a sweep going when one job fails
(unless ``fail_fast=true``), skips or resumes jobs of a sweep run again in its own dir
(``skip_finished=true``, or requeued by SLURM), and names the job's wandb run within its
sweep."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from transformers_lab.files import atomic_write
from transformers_lab.run.checkpoints import SavedCheckpoint, read_checkpoint
from transformers_lab.run.curves import RESUMED_AT, retire, set_aside
from transformers_lab.run.overrides import identity, in_multirun, job_overrides, same_job
from transformers_lab.run.record import (
    Interrupted,
    JobRecord,
    Monitor,
    Outcome,
    read_record,
    say,
    write_record,
)

log = logging.getLogger(__name__)


def run_job(
    cfg: DictConfig, fit: Callable[[DictConfig, SavedCheckpoint | None], Outcome]
) -> float | None:
    """Run ``fit(cfg, checkpoint)`` as a job: record it in ``<run dir>/result.json`` and
    return the monitored metric (what a sweeper optimises). ``checkpoint`` is
    ``cfg.ckpt_path`` read once (``read_checkpoint``; None without one): the job's wall
    time, its set-aside metrics and the fit all take it.

    The record says ``running`` from the start, so a job killed outright is known as
    such. In a multirun, a job that raises is recorded as failed and the sweep goes on,
    unless ``fail_fast=true``. With ``skip_finished=true`` (a sweep run again in its own
    dir) a job whose record shows it finished with the same overrides is not run again,
    and one that was interrupted or killed resumes from its own ``last.ckpt``.
    """
    out = Path(cfg.paths.output_dir)
    overrides = job_overrides()
    if (cfg.get("skip_finished") or requeued()) and (earlier := read_record(out)) is not None:
        if not same_job(earlier.overrides, overrides):
            log.warning("%s holds a job with other overrides: running afresh", out)
        elif earlier.status == "ok":
            print(f"run dir: {out}\nskipped: finished before (skip_finished=true)", flush=True)
            return math.nan if earlier.objective is None else earlier.objective
        elif earlier.status in ("running", "interrupted") and not cfg.get("ckpt_path"):
            resume_own_checkpoint(cfg)
    record = JobRecord(
        overrides=identity(overrides),
        run_dir=str(out),
        monitor=Monitor(cfg.monitor.metric, cfg.monitor.mode),
        trial=cfg.get("trial"),
    )
    start = time.perf_counter()
    try:
        checkpoint = None
        if cfg.get("ckpt_path"):
            checkpoint = read_checkpoint(cfg.ckpt_path, bool(cfg.get("trust_checkpoint")))
        keep_earlier_metrics(out, checkpoint)
        # a resumed job's wall time counts its earlier parts' (its checkpoint's fitting
        # time); a checkpoint only evaluated (train=false) is no part of this job
        if checkpoint is not None and cfg.get("train", True):
            start -= checkpoint.time_s
        save(record, start)
        outcome = fit(cfg, checkpoint)
    except Interrupted as exc:  # stop the sweep too: the user or the scheduler asked for it
        record.status, record.error = "interrupted", str(exc)
        record.monitor.best = exc.best_score
        record.checkpoints = {"best": exc.best, "last": exc.checkpoint}
        save(record, start)
        raise
    except Exception as exc:
        record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
        save(record, start)
        if not in_multirun():
            raise
        if cfg.get("fail_fast"):  # Hydra's launchers would run the remaining jobs first
            log.exception("job failed; fail_fast=true stops the sweep")
            print(
                f"error: job failed, sweep stopped (fail_fast=true): {record.error}",
                file=sys.stderr,
            )
            raise SystemExit(1) from exc
        log.exception("job failed; the sweep goes on (fail_fast=true would stop it)")
        print(f"job failed: {record.error} (recorded in {out}/result.json)", file=sys.stderr)
        return math.nan  # a failed trial to an Optuna sweeper, not the end of the study
    record.finished(outcome)
    save(record, start)
    if record.objective is None and in_multirun():
        log.warning("%s was never logged: the sweeper gets NaN for this job", cfg.monitor.metric)
        return math.nan
    return record.objective


def requeued() -> bool:
    """Whether SLURM runs this job again (a preemption, ``scontrol requeue``): then it
    resumes from its own ``last.ckpt`` as under ``skip_finished=true``."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0


def resume_own_checkpoint(cfg: DictConfig) -> None:
    """Set ``ckpt_path`` to the job's own ``last.ckpt``, if it saved one before it was
    stopped (else it starts afresh)."""
    folder = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
    last = Path(folder or Path(cfg.paths.output_dir) / "checkpoints") / "last.ckpt"
    moved = last.with_name("last.ckpt.old")  # a sharded save killed between its renames
    if not last.exists() and moved.is_dir():  # read where it is: every process alike
        last = moved
    if last.exists():  # a file, or a sharded checkpoint's folder
        why = "SLURM requeued this job" if requeued() else "skip_finished=true"
        say(f"resuming from {last} ({why}: this job was stopped before it ended)")
        with open_dict(cfg):
            cfg.ckpt_path = str(last)


def keep_earlier_metrics(out: Path, checkpoint: SavedCheckpoint | None) -> None:
    """A resume (``checkpoint``) in a dir that holds metrics keeps them, set aside
    (``set_aside_metrics``); a fresh start there moves them out of its curves
    (``curves.retire``)."""
    if checkpoint is not None:
        set_aside_metrics(out, checkpoint)
    elif rank_zero_only.rank == 0 and (old := retire(out)):
        log.warning("%s held an earlier attempt's metrics: moved to %s", out, old.name)


def set_aside_metrics(out: Path, checkpoint: SavedCheckpoint) -> None:
    """Move the stopped part's ``csv/`` to ``csv.<k>/`` before the job resumes in its own
    dir (Lightning's CSV logger would delete its metrics.csv), noting the step the next
    part starts at, so that ``tlab-summarize --curves`` joins the parts. Whether the
    resume was ``skip_finished=true``'s, SLURM's or a ``ckpt_path=`` given with the run's
    own ``hydra.run.dir``."""
    folder = out / "csv"
    if rank_zero_only.rank != 0 or not folder.is_dir():
        return
    earlier = set_aside(out)
    k = 1 + int(earlier[-1].suffix[1:]) if earlier else 1
    aside = folder.rename(out / f"csv.{k}")
    marker = {"step": checkpoint.step, "checkpoint": str(checkpoint.path)}
    atomic_write(aside / RESUMED_AT, json.dumps(marker) + "\n")


def save(record: JobRecord, start: float) -> None:
    """Write ``result.json`` with the job's wall time so far (the first process only)."""
    record.time_s = round(time.perf_counter() - start, 2)
    if rank_zero_only.rank == 0:
        write_record(record.run_dir, record)
