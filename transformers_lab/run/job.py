"""The job wrapper every ``tlab-train`` run goes through: it records the job in
``<run dir>/result.json`` from start to end, keeps a sweep going when one job fails
(unless ``fail_fast=true``), skips or resumes jobs of a sweep run again in its own dir
(``skip_finished=true``), and names the job's wandb run within its sweep."""

from __future__ import annotations

import json
import logging
import math
import shlex
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from transformers_lab.errors import Interrupted
from transformers_lab.files import atomic_write
from transformers_lab.run.checkpoints import checkpoint_step, checkpoint_time
from transformers_lab.run.common import say
from transformers_lab.run.curves import RESUMED_AT, retire, set_aside
from transformers_lab.run.overrides import SEED_KEYS, identity, override_key, same_job
from transformers_lab.run.record import JobRecord, Monitor, Outcome, read_record, write_record

log = logging.getLogger(__name__)


def hydra_config() -> DictConfig | None:
    """Hydra's config of this run, or None when ``train`` was called without Hydra."""
    return HydraConfig.get() if HydraConfig.initialized() else None


def in_multirun() -> bool:
    hydra_cfg = hydra_config()
    return hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN


def job_overrides() -> list[str]:
    """This job's overrides (the command line's, or the sweeper's for this job)."""
    hydra_cfg = hydra_config()
    if hydra_cfg is None:
        return []
    # unresolved: an override may hold an interpolation (data.batch_size=${model.d_model})
    return list(OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))


# keys of a sweep's command that its resume command sets itself (Hydra adds hydra.mode)
RESUME_SETS = ("hydra.sweep.dir", "skip_finished", "hydra.mode")


def sweep_resume(
    hydra_cfg: DictConfig | None = None, resumes: str = "this job resumes from it"
) -> list[str] | None:
    """For a job of a multirun, what finishes its sweep (words of a sentence, the command
    second): the sweep's own command (its ``hydra.*`` overrides included, such as the
    search path of the user's configs) with its sweep dir, with ``skip_finished=true`` for
    Hydra's sweeper (the finished jobs are skipped, this one resumes from its
    ``last.ckpt``: ``resumes``); an Optuna study's command as it is (the study gives this
    trial up and asks for its slot again). ``hydra_cfg``: Hydra's config of the sweep (a
    launcher's), else this job's. None outside a multirun."""
    hydra_cfg = hydra_cfg if hydra_cfg is not None else hydra_config()
    if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = Path(str(hydra_cfg.sweep.dir))
    path = sweep_dir / "multirun.yaml"
    saved = OmegaConf.load(path) if path.is_file() else OmegaConf.create()
    # as given: an override's ${...} is the job's to resolve (+callbacks.x.seed=${seed})
    given = OmegaConf.to_container(saved, resolve=False).get("hydra", {}).get("overrides", {})
    # the user's hydra.* overrides too: hydra.searchpath finds their kernels' configs
    master = [str(o) for part in ("hydra", "task") for o in given.get(part, ())]
    kept = [o for o in master if override_key(o) not in RESUME_SETS]
    words = ["-m", *kept, f"hydra.sweep.dir={sweep_dir}"]
    if "study_name" in (hydra_cfg.sweeper or {}):
        command = " ".join(shlex.quote(w) for w in words)
        return [
            "resume its study with",
            f"tlab-train {command}",
            "(this trial is given up, its slot asked again)",
        ]
    command = " ".join(shlex.quote(w) for w in [*words, "skip_finished=true"])
    return ["finish its sweep with", f"tlab-train {command}", f"({resumes})"]


def sweep_parameters(sweep_dir: Path) -> set[str]:
    """The keys a multirun sweeps: its sweeper's ``params`` and the command line's sweep
    overrides (``attention=softmax,dot``), read from the sweep's ``multirun.yaml``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = set((hydra_config().sweeper.get("params") or {}).keys())
    path = sweep_dir / "multirun.yaml"
    if path.is_file():
        master = [str(o) for o in OmegaConf.load(path).hydra.overrides.task]
        parsed = OverridesParser.create().parse_overrides(master)
        keys |= {o.key_or_group for o in parsed if o.is_sweep_override()}
    return keys


def name_wandb_run(cfg: DictConfig) -> None:
    """Fill the wandb logger's settings left null: in a multirun, one group for the whole
    sweep (its directory's name), a job_type per swept choice, seeds aside, and a name
    with every swept setting, seeds included; otherwise the run name and the task name.
    Its id is the job's (``wandb_run_id``), with ``resume="allow"``: a job resumed from
    its checkpoint goes on in the same wandb run, not a second one."""
    node = (cfg.get("logger") or {}).get("wandb")
    if node is None:
        return
    group, job_type, name = cfg.run_name, cfg.task_name, node.get("name")
    if in_multirun():
        sweep_dir = Path(cfg.paths.output_dir).parent
        group = f"{cfg.task_name}-{sweep_dir.name}"
        swept = sweep_parameters(sweep_dir)
        settings = [o for o in job_overrides() if override_key(o) in swept]
        choice = [o for o in settings if override_key(o) not in SEED_KEYS]
        job_type = " ".join(choice)[:64] or cfg.task_name
        name = " ".join([name or cfg.run_name, *settings])[:128]
    with open_dict(node):
        node.group = node.get("group") or group
        node.job_type = node.get("job_type") or job_type
        node.name = name
        node.id = node.get("id") or wandb_run_id(cfg)
        node.resume = node.get("resume") or "allow"


WANDB_ID = "wandb_id"  # a job dir's file: the wandb run its job logs to, resumes included


def wandb_run_id(cfg: DictConfig) -> str:
    """The wandb run id of this job: a resumed job's is the one its checkpoint's run dir
    recorded (``wandb_id``), a new job's a fresh random one (a fresh run in a reused dir is
    a new wandb run); written to the run dir, so a resume of this run finds it in turn."""
    out = Path(cfg.paths.output_dir)
    run_id = uuid.uuid4().hex[:16]
    if cfg.get("ckpt_path"):
        checkpoint = Path(cfg.ckpt_path).resolve()
        start = checkpoint.parent
        if start.name == "checkpoints":
            start = start.parent
        if (start / WANDB_ID).is_file():
            run_id = (start / WANDB_ID).read_text().strip()
    if rank_zero_only.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / WANDB_ID, run_id + "\n")
    return run_id


def run_job(cfg: DictConfig, fit: Callable[[DictConfig], Outcome]) -> float | None:
    """Run ``fit(cfg)`` as a job: record it in ``<run dir>/result.json`` and return the
    monitored metric (what a sweeper optimises).

    The record says ``running`` from the start, so a job killed outright is known as
    such. In a multirun, a job that raises is recorded as failed and the sweep goes on,
    unless ``fail_fast=true``. With ``skip_finished=true`` (a sweep run again in its own
    dir) a job whose record shows it finished with the same overrides is not run again,
    and one that was interrupted or killed resumes from its own ``last.ckpt``.
    """
    out = Path(cfg.paths.output_dir)
    overrides = job_overrides()
    if cfg.get("skip_finished") and (earlier := read_record(out)) is not None:
        if not same_job(earlier.overrides, overrides):
            log.warning("%s holds a job with other overrides: running afresh", out)
        elif earlier.status == "ok":
            print(f"run dir: {out}\nskipped: finished before (skip_finished=true)", flush=True)
            return math.nan if earlier.objective is None else earlier.objective
        elif earlier.status in ("running", "interrupted") and not cfg.get("ckpt_path"):
            resume_own_checkpoint(cfg)
    if not cfg.get("ckpt_path") and rank_zero_only.rank == 0 and (old := retire(out)):
        log.warning("%s held an earlier attempt's metrics: moved to %s", out, old.name)
    record = JobRecord(
        overrides=identity(overrides),
        run_dir=str(out),
        monitor=Monitor(cfg.monitor.metric, cfg.monitor.mode),
        trial=cfg.get("trial"),
    )
    # a resumed job's wall time counts its earlier parts' (its checkpoint's fitting time);
    # a checkpoint only evaluated (train=false) is no part of this job
    resumed = cfg.get("ckpt_path") and cfg.get("train", True)
    start = time.perf_counter() - (checkpoint_time(cfg.ckpt_path) if resumed else 0)
    save(record, start)
    try:
        outcome = fit(cfg)
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


def resume_own_checkpoint(cfg: DictConfig) -> None:
    """Set ``ckpt_path`` to the job's own ``last.ckpt``, if it saved one before it was
    stopped (else it starts afresh)."""
    folder = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath", default=None)
    last = Path(folder or Path(cfg.paths.output_dir) / "checkpoints") / "last.ckpt"
    if last.is_file():
        say(f"resuming from {last} (skip_finished=true: this job was stopped before it ended)")
        with open_dict(cfg):
            cfg.ckpt_path = str(last)
        set_aside_metrics(Path(cfg.paths.output_dir), last)


def set_aside_metrics(out: Path, checkpoint: Path) -> None:
    """Move the stopped part's ``csv/`` to ``csv.<k>/`` before the job resumes in its own
    dir (Lightning's CSV logger would delete its metrics.csv), noting the step the next
    part starts at, so that ``tlab-summarize --curves`` joins the parts."""
    folder = out / "csv"
    if rank_zero_only.rank != 0 or not folder.is_dir():
        return
    earlier = set_aside(out)
    k = 1 + int(earlier[-1].suffix[1:]) if earlier else 1
    aside = folder.rename(out / f"csv.{k}")
    marker = {"step": checkpoint_step(checkpoint), "checkpoint": str(checkpoint)}
    atomic_write(aside / RESUMED_AT, json.dumps(marker) + "\n")


def save(record: JobRecord, start: float) -> None:
    """Write ``result.json`` with the job's wall time so far (the first process only)."""
    record.time_s = round(time.perf_counter() - start, 2)
    if rank_zero_only.rank == 0:
        write_record(record.run_dir, record)
