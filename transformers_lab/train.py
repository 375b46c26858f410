"""tlab-train: compose the config, build data, model, task and trainer, fit, test.

tlab-train                                        # ViT on digits, offline, ~1 min
tlab-train experiment=baby_gpt                    # nanoGPT's CPU run on Tiny Shakespeare
tlab-train model=gpt data=mqar attention=fastmax attention.p=2
tlab-train ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt   # resume
python -m transformers_lab.train --help
"""

from __future__ import annotations

import logging
import os
from typing import Any

import hydra
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from transformers_lab.builders import (
    CONF_DIR,
    build_callbacks,
    build_datamodule,
    build_loggers,
    build_model,
    build_task,
    call,
    check_checkpoint,
    load_checkpoint,
    metrics_dict,
    resolved_sections,
)
from transformers_lab.cli import run_hydra, user_errors

log = logging.getLogger(__name__)


def prepare(datamodule: L.LightningDataModule) -> None:
    """Download or unpack the data before the model is sized from it (on the first local
    process only: under DDP the others start once the trainer launches them)."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        datamodule.prepare_data()


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


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test as ``cfg`` says; return the final metrics (validation, then test)."""
    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(cfg.data)
    prepare(datamodule)
    model = build_model(cfg.model, datamodule)
    task = build_task(cfg.task, model, datamodule)
    task.run_config = resolved_sections(cfg)
    log.info("model %s: %s parameters", type(model).__name__, f"{task.num_params:,}")
    if cfg.get("ckpt_path"):
        check_checkpoint(load_checkpoint(cfg.ckpt_path), task, cfg.ckpt_path)

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
        if cfg.get("train", True):
            trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = metrics_dict(trainer.callback_metrics)
        # read before testing: loading the best checkpoint restores the callback's state
        checkpoints = {k: checkpoint_path(trainer, f"{k}_model_path") for k in ("best", "last")}
        if cfg.get("test") and is_overridden("test_dataloader", datamodule):
            if checkpoints["best"] is None:
                log.warning("no best checkpoint saved: testing the weights in memory")
            tested = trainer.test(task, datamodule=datamodule, ckpt_path=checkpoints["best"])
            metrics.update(metrics_dict(tested[0] if tested else {}))
    finally:
        finish_wandb(trainer)
    report(metrics, checkpoints)
    return metrics


def checkpoint_path(trainer: L.Trainer, which: str) -> str | None:
    """``best_model_path`` or ``last_model_path`` of the checkpoint callback, if saved."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, which, "") if callback is not None else ""
    return path or None


def print_metrics(metrics: dict[str, float]) -> None:
    """The run's last lines: its final metrics, one per line."""
    print("final metrics:", flush=True)
    for name, value in metrics.items():
        print(f"  {name}: {value:.6g}")


def report(metrics: dict[str, float], checkpoints: dict[str, str | None]) -> None:
    print_metrics(metrics)
    print(f"best checkpoint: {checkpoints['best']}")
    print(f"last checkpoint: {checkpoints['last']}", flush=True)


def objective(cfg: DictConfig, metrics: dict[str, float]) -> float | None:
    """The monitored metric, returned to Hydra (what an Optuna sweeper optimises)."""
    return metrics.get(cfg.monitor.metric)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    with user_errors():
        return objective(cfg, train(cfg))


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
