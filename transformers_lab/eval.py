"""tlab-eval: evaluate a tlab-train checkpoint on its validation or test split.

    tlab-eval ckpt_path=logs/train/runs/<time>/checkpoints/best.ckpt
    tlab-eval ckpt_path=... split=test +data.batch_size=256

The model, data and task configs are read from the checkpoint (``tlab_config``), so the
metric is the one logged during training for the same weights.
"""

from __future__ import annotations

import logging

import hydra
import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig

from transformers_lab.cli import run_hydra, user_errors
from transformers_lab.config import CONF_DIR
from transformers_lab.errors import ConfigError
from transformers_lab.run.build import build_loggers, call, use_cpu_threads
from transformers_lab.run.checkpoints import restore
from transformers_lab.run.fit import metrics_dict, print_metrics
from transformers_lab.run.loggers import finish_wandb
from transformers_lab.run.preflight import check_config

log = logging.getLogger(__name__)

SPLITS = ("val", "test")


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """The metrics of ``cfg.ckpt_path`` on ``cfg.split``."""
    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    check_config(cfg)
    if cfg.split not in SPLITS:
        raise ConfigError(f"split={cfg.split} is not one of {', '.join(SPLITS)}")
    use_cpu_threads(cfg)
    L.seed_everything(cfg.seed, workers=True)
    checkpoint, datamodule, task = restore(cfg.ckpt_path, cfg.get("data"))
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
