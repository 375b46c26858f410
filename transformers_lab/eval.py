"""tlab-eval: evaluate a tlab-train checkpoint on its validation or test split.

    tlab-eval ckpt_path=logs/train/runs/<time>/checkpoints/best.ckpt
    tlab-eval ckpt_path=... split=test +data.batch_size=256

The model, data and task configs are read from the checkpoint (``tlab_config``), so the
metric is the one logged during training for the same weights.
"""

from __future__ import annotations

import logging
from typing import Any

import hydra
import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from transformers_lab.builders import (
    CONF_DIR,
    ConfigError,
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
from transformers_lab.train import finish_wandb, prepare, print_metrics
from transformers_lab.validation import validate_config

log = logging.getLogger(__name__)

SPLITS = ("val", "test")


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


def checkpoint_data(checkpoint: dict[str, Any], run: DictConfig) -> L.LightningDataModule:
    """The data module of a saved run, with the tokenizer state the checkpoint holds
    (the vocabulary the model was trained with)."""
    datamodule = build_datamodule(run.data)
    state = checkpoint.get(type(datamodule).__qualname__)
    if state:
        datamodule.load_state_dict(state)
    return datamodule


def restore(cfg: DictConfig) -> tuple[dict[str, Any], L.LightningDataModule, Any]:
    """The checkpoint, its data module (tokenizer restored) and its task, weights loaded."""
    checkpoint = load_checkpoint(cfg.ckpt_path)
    run = saved_run(checkpoint, cfg.ckpt_path, cfg.get("data"))
    datamodule = checkpoint_data(checkpoint, run)
    prepare(datamodule)
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
    datamodule.setup("fit")
    return task.eval(), datamodule


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """The metrics of ``cfg.ckpt_path`` on ``cfg.split``."""
    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    validate_config(cfg)
    if cfg.split not in SPLITS:
        raise ConfigError(f"split={cfg.split} is not one of {', '.join(SPLITS)}")
    L.seed_everything(cfg.seed, workers=True)
    checkpoint, datamodule, task = restore(cfg)
    if cfg.split == "test" and not is_overridden("test_dataloader", datamodule):
        raise ConfigError(f"{type(datamodule).__name__} has no test split; use split=val")
    trainer = None
    try:
        trainer = call(cfg.trainer, "trainer", logger=build_loggers(cfg.get("logger")) or False)
        run = trainer.validate if cfg.split == "val" else trainer.test
        results = run(task, datamodule=datamodule)
    finally:
        finish_wandb(trainer)
    metrics = metrics_dict(results[0] if results else {})
    print(
        f"checkpoint: {cfg.ckpt_path} (epoch {checkpoint.get('epoch')}, "
        f"step {checkpoint.get('global_step')})"
    )
    print_metrics(metrics)
    return metrics


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="eval")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        evaluate(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
