"""tlab-eval: evaluate a tlab-train checkpoint on its validation or test split.

    tlab-eval ckpt_path=logs/train/runs/<time>/checkpoints/best.ckpt
    tlab-eval ckpt_path=... split=test +data.batch_size=256
    tlab-eval ckpt_path=... eval_lengths=[64,128,256,512]   # past the trained length
    tlab-eval ckpt_path=... eval_lengths=[256,512] eval_depths=[0,0.5,1]   # needles
    tlab-eval ckpt_path=... eval_lengths=[256,1024] loss_by_position=16

The model, data and task configs are read from the checkpoint (``tlab_config``), so the
metric is the one logged during training for the same weights. ``eval_lengths`` scores
it at other lengths instead, the model rebuilt at each (``run.lengths``): the metrics are
named ``val/acc@256`` (``val/acc@256:d0.5`` at a needle depth) and written to
``lengths.csv`` in the run dir; ``loss_by_position`` writes ``loss_by_position.csv`` and
``.png``.

``harness.tasks`` scores it on lm-evaluation-harness's tasks instead (``run.harness``):

    tlab-eval ckpt_path=... harness.tasks=[lambada_openai,piqa]
    tlab-eval ckpt_path=... harness=field          # the field's table, zero-shot
    tlab-eval ckpt_path=... harness.tasks=[mine] harness.include_path=my_tasks/
    tlab-eval sweep_dir=logs/train/multiruns/<time> harness=field   # a sweep's kernels

The metrics are named ``harness/<task>/<metric>``, logged to the run's loggers and
written with the harness's whole results to ``harness.json`` in the run dir. With
``sweep_dir``, each kernel of the sweep is scored at its best rate (``sweeps.harness``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, OmegaConf

from transformers_lab.cli import refusals_leave_no_run_dir, run_hydra, user_errors
from transformers_lab.config import CONF_DIR, migrate_targets
from transformers_lab.errors import ConfigError
from transformers_lab.run.values import LengthOptions, check_values

if TYPE_CHECKING:
    from transformers_lab.run.checkpoints import SavedCheckpoint

# torch, Lightning and the run's code are imported once the values are checked (in the
# functions below): a mistake in a value is refused in about a second

log = logging.getLogger(__name__)

SPLITS = ("val", "test")


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """The metrics of ``cfg.ckpt_path`` on ``cfg.split``."""
    import lightning as L

    from transformers_lab.run.checkpoints import read_checkpoint
    from transformers_lab.run.components import check_split, restore, use_cpu
    from transformers_lab.run.preflight import check_config
    from transformers_lab.run.record import metrics_dict, print_metrics
    from transformers_lab.run.trainer import build_trainer, finish_wandb

    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    sweep_or_checkpoint(cfg)
    migrate_targets(cfg)  # a _target_ of an earlier version, to its new home
    lengths = check_config(cfg)
    if cfg.split not in SPLITS:
        raise ConfigError(f"split={cfg.split} is not one of {', '.join(SPLITS)}")
    harness = bool(cfg.get("harness")) and cfg.harness.get("tasks") is not None
    if harness and lengths is not None:
        raise ConfigError(
            "harness.tasks and eval_lengths are two evaluations: the harness scores at the "
            "model's own context; run them as two tlab-eval commands"
        )
    use_cpu(cfg)
    if cfg.get("sweep_dir"):
        return evaluate_sweep(cfg)
    checkpoint = read_checkpoint(cfg.ckpt_path, bool(cfg.get("trust_checkpoint")))
    L.seed_everything(cfg.seed, workers=True)
    if harness:
        return evaluate_on_harness(cfg, checkpoint)
    if lengths is not None:
        return evaluate_at_lengths(cfg, checkpoint, lengths)
    _, datamodule, task = restore(checkpoint, checkpoint.run_config(cfg.get("data")))
    check_split(datamodule, cfg.split)
    trainer = None
    try:
        trainer = build_trainer(cfg, purpose="evaluate")
        run = trainer.validate if cfg.split == "val" else trainer.test
        results = run(task, datamodule=datamodule)
    finally:
        finish_wandb(trainer)
    metrics = metrics_dict(results[0] if results else {})
    print(f"checkpoint: {cfg.ckpt_path} (epoch {checkpoint.epoch}, step {checkpoint.step})")
    print_metrics(metrics)
    return metrics


def evaluate_at_lengths(
    cfg: DictConfig, checkpoint: SavedCheckpoint, lengths: LengthOptions
) -> dict[str, float]:
    """``evaluate`` at each of the ``lengths`` (and needle depth): the metrics, also
    written to ``lengths.csv`` (and the loss by position) in the run dir."""
    from transformers_lab.analysis.positions import write_position_losses
    from transformers_lab.run.lengths import evaluate_lengths, write_lengths
    from transformers_lab.run.record import print_metrics
    from transformers_lab.run.trainer import build_trainer

    data = OmegaConf.to_container(cfg.data, resolve=True) if cfg.get("data") else {}
    metrics, positions, trained = evaluate_lengths(
        checkpoint, lengths, lambda: build_trainer(cfg, purpose="score"), data, cfg.split
    )
    out = Path(cfg.paths.output_dir)
    print(f"checkpoint: {cfg.ckpt_path}")
    print_metrics(metrics)
    print(f"lengths: {write_lengths(metrics, out)}")
    if positions:
        print(f"loss by position: {write_position_losses(positions, trained, out)}")
    return metrics


def evaluate_on_harness(cfg: DictConfig, checkpoint: SavedCheckpoint) -> dict[str, float]:
    """The checkpoint's scores on lm-evaluation-harness's tasks (``cfg.harness``): printed,
    logged to the run's loggers, and written to ``harness.json`` in the run dir."""
    from transformers_lab.run.harness import harness_table, score_checkpoint, write_results
    from transformers_lab.run.trainer import build_trainer, finish_wandb

    options = cfg.harness
    data = cfg.get("data")
    metrics, results = score_checkpoint(checkpoint, cfg.ckpt_path, options, data)
    trainer = None
    try:
        trainer = build_trainer(cfg, purpose="evaluate")
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=checkpoint.step)
            logger.save()
    finally:
        finish_wandb(trainer)
    report = options.get("report")
    print(f"checkpoint: {cfg.ckpt_path} (epoch {checkpoint.epoch}, step {checkpoint.step})")
    print(harness_table(metrics, None if report is None else OmegaConf.to_container(report)))
    print(f"harness results: {write_results(results, Path(cfg.paths.output_dir))}")
    return metrics


def evaluate_sweep(cfg: DictConfig) -> dict[str, float]:
    """A sweep's jobs at their cells' best rate on the harness's tasks (``sweeps.harness``)."""
    if not cfg.get("harness") or cfg.harness.get("tasks") is None:
        raise ConfigError(
            "sweep_dir scores a sweep's checkpoints on lm-evaluation-harness's tasks: name "
            "them, harness.tasks=[...] or harness=field"
        )
    from transformers_lab.sweeps.harness import score_sweep

    trust = bool(cfg.get("trust_checkpoint"))
    rows = score_sweep(cfg.sweep_dir, cfg.harness, trust, cfg.get("data"))
    print(f"harness table: {Path(cfg.sweep_dir) / 'harness.md'}")
    return {f"{row['choice']}|{k}": v for row in rows for k, v in row.items() if is_number(v)}


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def sweep_or_checkpoint(cfg: DictConfig) -> None:
    """A sweep's checkpoints are its jobs': with ``sweep_dir``, ``ckpt_path`` is none."""
    if cfg.get("sweep_dir") and OmegaConf.is_missing(cfg, "ckpt_path"):
        cfg.ckpt_path = None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="eval")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors(), refusals_leave_no_run_dir():
        sweep_or_checkpoint(cfg)
        check_values(cfg)  # in about a second: torch is not imported yet
        evaluate(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
