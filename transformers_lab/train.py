"""tlab-train: compose the config, build data, model, task and trainer, fit, test.

tlab-train                                        # ViT on digits, offline, ~1 min
tlab-train experiment=baby_gpt                    # nanoGPT's CPU run on Tiny Shakespeare
tlab-train model=gpt data=mqar attention=fastmax attention.p=2
tlab-train ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt   # resume
tlab-train sweep=attention_kernels experiment=mqar   # a multirun, summarised at its end
python -m transformers_lab.train --help

Every run records its outcome in ``<run dir>/result.json`` (see ``analysis.summary``).
In a multirun a failed job is recorded there and the sweep goes on (``fail_fast=true``
stops it); ``skip_finished=true`` with ``hydra.sweep.dir=<old sweep>`` skips the jobs that
already finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import (
    MisconfigurationException,
    SIGTERMException,
)
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf, open_dict

from transformers_lab.analysis.curves import RESUMED_AT, retire, set_aside
from transformers_lab.analysis.summary import (
    BOOKKEEPING_KEYS,
    SEED_KEYS,
    atomic_write,
    read_result,
    write_result,
)
from transformers_lab.builders import (
    CONF_DIR,
    ConfigError,
    build_callbacks,
    build_datamodule,
    build_loggers,
    build_model,
    build_task,
    call,
    check_checkpoint,
    check_resume,
    checkpoint_step,
    compile_model,
    load_checkpoint,
    metrics_dict,
    override_key,
    resolved_sections,
)
from transformers_lab.cli import run_hydra, user_errors
from transformers_lab.models import GPT
from transformers_lab.safety import (
    Interrupted,
    RunStopped,
    interrupted,
    interrupted_testing,
)
from transformers_lab.validation import validate_config

log = logging.getLogger(__name__)


def prepare(datamodule: L.LightningDataModule) -> None:
    """Download or unpack the data before the model is sized from it (on the first local
    process only: under DDP the others start once the trainer launches them)."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        datamodule.prepare_data()


def say(*lines: str, file: Any = None) -> None:
    """Print on the first process only (under DDP every process runs this script)."""
    if rank_zero_only.rank == 0:
        print(*lines, sep="\n", file=file or sys.stdout, flush=True)


def log_hyperparameters(cfg: DictConfig, task: Any, trainer: L.Trainer) -> None:
    """The whole resolved config and the parameter counts, to every logger."""
    hparams = OmegaConf.to_container(cfg, resolve=True)
    hparams.pop("hydra", None)
    hparams.update(task.counts)
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)


def finish_wandb(trainer: L.Trainer | None) -> None:
    for logger in trainer.loggers if trainer else ():
        if isinstance(logger, WandbLogger):
            import wandb

            wandb.finish()


@dataclass
class RunResult:
    metrics: dict[str, float]  # final metrics: validation, then test
    best: float | None  # the monitored metric's best value (the best checkpoint's score)
    num_params: int
    checkpoints: dict[str, str | None]  # best and last
    state_size: int | None = None  # a GPT's decoding state after block_size tokens


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test as ``cfg`` says; return the final metrics (validation, then test)."""
    return fit_and_test(cfg).metrics


def fit_and_test(cfg: DictConfig) -> RunResult:
    """Fit and test as ``cfg`` says."""
    say(f"run dir: {cfg.paths.output_dir}")
    validate_config(cfg)
    # resuming: the checkpoint's model, data and task config hold (checked before building)
    checkpoint = load_checkpoint(cfg.ckpt_path) if cfg.get("ckpt_path") else None
    if checkpoint is not None:
        may_change = list(cfg.get("resume_may_change") or ())
        check_resume(checkpoint, resolved_sections(cfg), cfg.ckpt_path, may_change)
    if cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    L.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(cfg.data)
    prepare(datamodule)
    model = build_model(cfg.model, datamodule)
    task = build_task(cfg.task, model, datamodule)
    task.run_config = resolved_sections(cfg)
    log.info("model %s: %s parameters", type(model).__name__, f"{task.num_params:,}")
    if cfg.get("compile") and (why := compile_model(model)):
        say(f"compile=true: torch.compile is unavailable here ({why}); training in eager mode")
    resumed_step = None
    if checkpoint is not None:  # and its tensors fit (a checkpoint with no saved config)
        check_checkpoint(checkpoint, task, cfg.ckpt_path, task.run_config)
        resumed_step = checkpoint.get("global_step")
        del checkpoint  # Lightning loads it again to restore the run

    name_wandb_run(cfg)
    loggers = build_loggers(cfg.get("logger"))
    callbacks = build_callbacks(
        cfg.get("callbacks"),
        with_logger=bool(loggers),
        progress_bar=cfg.trainer.get("enable_progress_bar", True),
    )
    trainer = None
    try:
        # without our ModelCheckpoint, Lightning would otherwise add a default one
        checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
        trainer = call(
            cfg.trainer,
            "trainer",
            callbacks=callbacks,
            logger=loggers or False,
            enable_checkpointing=checkpointing,
        )
        log_hyperparameters(cfg, task, trainer)
        training = cfg.get("train", True)
        if training:
            try:
                trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
            except SIGTERMException:  # SIGTERM or Ctrl+C: last.ckpt is saved
                raise interrupted(trainer, job_overrides()) from None
            if resumed_step is not None and trainer.global_step == resumed_step:
                say(nothing_left_to_train(cfg, resumed_step))
        metrics = metrics_dict(trainer.callback_metrics)
        # read before testing: loading the best checkpoint restores the callback's state
        checkpoints = {k: checkpoint_path(trainer, f"{k}_model_path") for k in ("best", "last")}
        best = best_score(trainer)
        if cfg.get("test") and is_overridden("test_dataloader", datamodule):
            # without training, test the checkpoint given (else the model as built)
            tested_ckpt = checkpoints["best"] if training else cfg.get("ckpt_path")
            if tested_ckpt is None:
                trained = "trained" if training else "untrained (train=false)"
                log.warning("no checkpoint to test: testing the %s weights in memory", trained)
            try:
                tested = trainer.test(task, datamodule=datamodule, ckpt_path=tested_ckpt)
            except SIGTERMException:
                raise interrupted_testing(trainer, tested_ckpt) from None
            metrics.update(metrics_dict(tested[0] if tested else {}))
        elif cfg.get("test"):
            say(
                f"test=true: {type(datamodule).__name__} has no test split, so the run ends "
                "with its validation metrics"
            )
    except MisconfigurationException as exc:  # Lightning's word on a setting that cannot work
        raise ConfigError(f"Lightning refused the run: {exc}") from exc
    finally:
        finish_wandb(trainer)
    report(metrics, checkpoints)
    state = model.state_size() if isinstance(model, GPT) else None
    return RunResult(metrics, best, task.num_params, checkpoints, state)


def nothing_left_to_train(cfg: DictConfig, step: int) -> str:
    """What a resumed run that trained no step says: its checkpoint had already reached
    the trainer's limits (a finished run, resumed without raising them)."""
    limits = f"max_epochs={cfg.trainer.max_epochs}, max_steps={cfg.trainer.max_steps}"
    return (
        f"nothing left to train: {cfg.ckpt_path} is at global step {step}, where the "
        f"trainer's {limits} end the run; raise trainer.max_epochs or trainer.max_steps to "
        "train further (no new last.ckpt is written)"
    )


def checkpoint_path(trainer: L.Trainer, which: str) -> str | None:
    """``best_model_path`` or ``last_model_path`` of the checkpoint callback, if saved."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, which, "") if callback is not None else ""
    return path or None


def best_score(trainer: L.Trainer) -> float | None:
    """The best value of the monitored metric, as the checkpoint callback saw it."""
    score = getattr(trainer.checkpoint_callback, "best_model_score", None)
    return None if score is None else float(score)


def print_metrics(metrics: dict[str, float]) -> None:
    """The run's last lines: its final metrics, one per line."""
    say("final metrics:", *(f"  {name}: {value:.6g}" for name, value in metrics.items()))


def report(metrics: dict[str, float], checkpoints: dict[str, str | None]) -> None:
    print_metrics(metrics)
    say(f"best checkpoint: {checkpoints['best']}", f"last checkpoint: {checkpoints['last']}")


def objective(cfg: DictConfig, metrics: dict[str, float]) -> float | None:
    """The monitored metric, returned to Hydra (what an Optuna sweeper optimises)."""
    return metrics.get(cfg.monitor.metric)


# ---------------------------------------------------------------- jobs of a sweep


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


def identity(overrides: list[str]) -> list[str]:
    """The overrides that say what a job is: its own, bookkeeping keys left out."""
    return [o for o in overrides if override_key(o) not in BOOKKEEPING_KEYS]


def what_it_runs(overrides: list[str]) -> list[str]:
    return sorted(identity(overrides))


def swept_keys(sweep_dir: Path) -> set[str]:
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
    """Fill the wandb logger's group and job_type left null: in a multirun, one group
    for the whole sweep (its directory's name) and a job_type per swept choice, seeds
    aside; otherwise the run name and the task name."""
    node = (cfg.get("logger") or {}).get("wandb")
    if node is None:
        return
    group, job_type = cfg.run_name, cfg.task_name
    if in_multirun():
        sweep_dir = Path(cfg.paths.output_dir).parent
        group = f"{cfg.task_name}-{sweep_dir.name}"
        swept = swept_keys(sweep_dir) - set(SEED_KEYS)
        choice = [o for o in job_overrides() if override_key(o) in swept]
        job_type = " ".join(choice)[:64] or cfg.task_name
    with open_dict(node):
        node.group = node.get("group") or group
        node.job_type = node.get("job_type") or job_type


def run_job(cfg: DictConfig) -> float | None:
    """Train as ``cfg`` says and record the outcome in ``<run dir>/result.json``.

    The record says ``running`` from the start, so a job killed outright is known as
    such. In a multirun, a job that raises is recorded as failed and the sweep goes on,
    unless ``fail_fast=true``. With ``skip_finished=true`` (a sweep run again in its own
    dir) a job whose record shows it finished with the same overrides is not run again,
    and one that was interrupted or killed resumes from its own ``last.ckpt``.
    """
    out = Path(cfg.paths.output_dir)
    overrides = job_overrides()
    if cfg.get("skip_finished") and (earlier := read_result(out)) is not None:
        if what_it_runs(earlier.get("overrides", [])) != what_it_runs(overrides):
            log.warning("%s holds a job with other overrides: running afresh", out)
        elif earlier.get("status") == "ok":
            print(f"run dir: {out}\nskipped: finished before (skip_finished=true)", flush=True)
            value = earlier.get("objective")
            return math.nan if value is None else value
        elif earlier.get("status") in ("running", "interrupted") and not cfg.get("ckpt_path"):
            resume_own_checkpoint(cfg)
    if not cfg.get("ckpt_path") and rank_zero_only.rank == 0 and (old := retire(out)):
        log.warning("%s held an earlier attempt's metrics: moved to %s", out, old.name)
    record: dict[str, Any] = {
        "overrides": identity(overrides),
        "run_dir": str(out),
        "monitor": {"metric": cfg.monitor.metric, "mode": cfg.monitor.mode, "best": None},
    }
    start = time.perf_counter()
    record_result(out, {**record, "status": "running"}, start)
    try:
        result = fit_and_test(cfg)
    except Interrupted as exc:  # stop the sweep too: the user or the scheduler asked for it
        record["monitor"]["best"] = exc.best_score
        record.update(
            status="interrupted",
            error=str(exc),
            checkpoints={"best": exc.best, "last": exc.checkpoint},
        )
        record_result(out, record, start)
        raise
    except Exception as exc:
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        record_result(out, record, start)
        if not in_multirun():
            raise
        if cfg.get("fail_fast"):  # Hydra's launchers would run the remaining jobs first
            log.exception("job failed; fail_fast=true stops the sweep")
            print(
                f"error: job failed, sweep stopped (fail_fast=true): {record['error']}",
                file=sys.stderr,
            )
            raise SystemExit(1) from exc
        log.exception("job failed; the sweep goes on (fail_fast=true would stop it)")
        print(f"job failed: {record['error']} (recorded in {out}/result.json)", file=sys.stderr)
        return math.nan  # a failed trial to an Optuna sweeper, not the end of the study
    value = objective(cfg, result.metrics)
    record["monitor"]["best"] = result.best
    record.update(
        status="ok",
        metrics=result.metrics,
        objective=value,
        params=result.num_params,
        state_size=result.state_size,
        checkpoints=result.checkpoints,
        error=None,
    )
    record_result(out, record, start)
    if value is None and in_multirun():
        log.warning("%s was never logged: the sweeper gets NaN for this job", cfg.monitor.metric)
        return math.nan
    return value


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


def record_result(out: Path, record: dict[str, Any], start: float) -> None:
    """Write ``result.json`` with the job's wall time (the first process only)."""
    record["time_s"] = round(time.perf_counter() - start, 2)
    if rank_zero_only.rank == 0:
        write_result(out, record)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    with user_errors():
        try:
            return run_job(cfg)
        except RunStopped as exc:  # a NaN, or a signal: one line, no traceback
            say(str(exc) if isinstance(exc, Interrupted) else f"error: {exc}", file=sys.stderr)
            raise SystemExit(exc.exit_code) from None


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
