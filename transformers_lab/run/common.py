"""What the entry points share about a run: its CPU threads, restoring one from its
checkpoint, the lines it prints, the final test, and closing its loggers. No entry point
imports another; they all import this."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from transformers_lab.config import resolved_sections
from transformers_lab.errors import ConfigError
from transformers_lab.run.build import build_datamodule, build_model, build_task
from transformers_lab.run.checkpoints import check_checkpoint, load_checkpoint
from transformers_lab.run.safety import interrupted_testing

log = logging.getLogger(__name__)


def metrics_dict(metrics: dict[str, Any]) -> dict[str, float]:
    """Tensor metrics as plain floats, sorted by name."""
    return {k: float(v) for k, v in sorted(metrics.items())}


def use_cpu_threads(cfg: DictConfig) -> None:
    """Give torch the run's ``cpu_threads`` (null: torch's default), so that runs that share
    a machine do not each take all of its cores."""
    if cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))


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
    """``best_model_path`` or ``last_model_path`` of the checkpoint callback, if saved: a
    path the callback names but never wrote (``debug=fdr``, whose fast_dev_run saves
    nothing, still sets ``last_model_path``) is None."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, which, "") if callback is not None else ""
    if path and "://" not in path and not Path(path).is_file():
        return None
    return path or None


def best_score(trainer: L.Trainer) -> float | None:
    """The best value of the monitored metric, as the checkpoint callback saw it."""
    score = getattr(trainer.checkpoint_callback, "best_model_score", None)
    return None if score is None else float(score)


def print_metrics(metrics: dict[str, float]) -> None:
    """The run's last lines: its final metrics, one per line."""
    say("final metrics:", *(f"  {name}: {value:.6g}" for name, value in metrics.items()))


def final_test(
    trainer: L.Trainer,
    task: L.LightningModule,
    datamodule: L.LightningDataModule,
    checkpoint: str | None,
    trained: bool,
) -> dict[str, float]:
    """The test metrics of ``checkpoint`` (None: the weights in memory), or none when the
    data has no test split (the run then ends with its validation metrics)."""
    if not is_overridden("test_dataloader", datamodule):
        say(
            f"test=true: {type(datamodule).__name__} has no test split, so the run ends "
            "with its validation metrics"
        )
        return {}
    if checkpoint is None:
        weights = "trained" if trained else "untrained (train=false)"
        log.warning("no checkpoint to test: testing the %s weights in memory", weights)
    try:
        tested = trainer.test(task, datamodule=datamodule, ckpt_path=checkpoint)
    except SIGTERMException:
        raise interrupted_testing(trainer, checkpoint) from None
    return metrics_dict(tested[0] if tested else {})


def report(metrics: dict[str, float], checkpoints: dict[str, str | None]) -> None:
    print_metrics(metrics)
    say(f"best checkpoint: {checkpoints['best']}", f"last checkpoint: {checkpoints['last']}")


def saved_run(checkpoint: dict[str, Any], path: Any, data_overrides: Any) -> DictConfig:
    """The run config stored in a checkpoint, with the command line's ``data.*`` merged."""
    saved = checkpoint.get("tlab_config")
    if not saved:
        raise ConfigError(
            f"checkpoint {path} holds no tlab_config: it was not written by tlab-train, so "
            f"its model cannot be rebuilt; train with tlab-train, or load it in Python"
        )
    run = OmegaConf.create(saved)
    run.data = OmegaConf.merge(run.data, data_overrides or {})
    return run


def restore(cfg: DictConfig) -> tuple[dict[str, Any], L.LightningDataModule, Any]:
    """The checkpoint, its data module (tokenizer restored) and its task, weights loaded."""
    checkpoint = load_checkpoint(cfg.ckpt_path)
    run = saved_run(checkpoint, cfg.ckpt_path, cfg.get("data"))
    datamodule = build_datamodule(run.data, checkpoint)  # the tokenizer it was trained with
    task = build_task(run.task, build_model(run.model, datamodule), datamodule)
    check_checkpoint(checkpoint, task, cfg.ckpt_path, resolved_sections(run))
    task.load_state_dict(checkpoint["state_dict"])
    return checkpoint, datamodule, task


def load_task(
    ckpt_path: str | Any, data: dict[str, Any] | None = None
) -> tuple[Any, L.LightningDataModule]:
    """A checkpoint's task in eval mode, weights loaded (``task.model`` is the network),
    and its data module set up with the tokenizer it was trained with; for notebooks and
    scripts. ``data`` overrides entries of the saved data config (e.g. ``batch_size``)."""
    config = OmegaConf.create({"ckpt_path": str(ckpt_path), "data": data or {}})
    _, datamodule, task = restore(config)
    return task.eval(), datamodule


def load_weights(
    model: torch.nn.Module, checkpoint: dict[str, Any], path: Any, run: DictConfig
) -> torch.nn.Module:
    """``model`` (built from ``run``, the saved config) with the checkpoint's weights, in
    eval mode."""
    wrapper = torch.nn.Module()
    wrapper.model = model  # the task's parameter names are "model.*"
    check_checkpoint(checkpoint, wrapper, path, resolved_sections(run))
    wrapper.load_state_dict(checkpoint["state_dict"])
    return model.eval()
