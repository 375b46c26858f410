"""One run, fit and tested as its config says (``fit_and_test``), a line a step as a run
takes them: an earlier version's ``_target_`` followed (``config``), the config checked
before any data is read (``preflight``), the checkpoint it resumes read once and held to
it (``checkpoints``), a budget in tokens made steps (``budget``), data, model and task
built (``components``), the trainer with its loggers, W&B named (``trainer``), fit and
test (here), the evaluation past the trained length (``lengths``), and its ``Outcome``
(``record``). ``tlab-train`` runs it as a job (``run.job``), which reads the checkpoint."""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig

from transformers_lab.config import migrate_targets
from transformers_lab.run import budget
from transformers_lab.run.callbacks.safety import StopOnSignal
from transformers_lab.run.checkpoints import Resume, SavedCheckpoint, resume_from
from transformers_lab.run.components import Components, build_components
from transformers_lab.run.lengths import score_lengths
from transformers_lab.run.overrides import job_overrides, override_key, sweep_resume
from transformers_lab.run.preflight import check_config
from transformers_lab.run.record import Interrupted, Outcome, metrics_dict, outcome, say
from transformers_lab.run.trainer import build_trainer, finish_wandb, lightning_refusals

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test as ``cfg`` says; return the final metrics (validation, then test)."""
    return fit_and_test(cfg).metrics


def fit_and_test(
    cfg: DictConfig,
    checkpoint: SavedCheckpoint | None = None,
    callbacks: Sequence[L.Callback] = (),
) -> Outcome:
    """Fit and test as ``cfg`` says, resuming ``checkpoint`` (``cfg.ckpt_path``, already
    read by the job; read here when not); ``callbacks`` join the trainer's (the caller's:
    a study's pruning callback, ``sweeps.pruning``)."""
    say(f"run dir: {cfg.paths.output_dir}")
    migrate_targets(cfg)  # a _target_ of an earlier version, to its new home
    lengths = check_config(cfg)  # everything that can be refused before any data is read
    resume = resume_from(cfg, checkpoint)  # and the checkpoint's config held to this one
    token_plan = budget.apply(cfg, resume.checkpoint)  # a budget in tokens, as steps
    parts = build_components(cfg, resume, fingerprint=True)
    trainer = build_trainer(cfg, callbacks, task=parts.task, resumed=resume.checkpoint)
    budget.check_world(token_plan, trainer.world_size)
    try:
        fitted = fit(cfg, parts, trainer, resume)
    finally:
        finish_wandb(trainer)
    if lengths and fitted.pruned_at is None and trainer.global_rank == 0:
        fitted.metrics.update(score_lengths(cfg, lengths, fitted.checkpoints, resume.checkpoint))
    return outcome(fitted, parts)


class Fitted(NamedTuple):
    """What fitting and testing gave: the final metrics, the monitored metric's best
    value, the best and last checkpoints, the step a pruner stopped it at."""

    metrics: dict[str, float]
    best: float | None
    checkpoints: dict[str, str | None]
    pruned_at: int | None


def fit(cfg: DictConfig, parts: Components, trainer: L.Trainer, resume: Resume) -> Fitted:
    """Fit (unless ``train=false``) from the checkpoint resumed, then test (``test=true``):
    without training, the checkpoint given (else the model as built); a trial its pruner
    stopped is not worth a test."""
    trust, training = bool(cfg.get("trust_checkpoint")), cfg.get("train", True)
    log.info("model %s: %s parameters", type(parts.model).__name__, f"{parts.task.num_params:,}")
    with lightning_refusals():
        if training:
            fit_from(cfg, parts, trainer, resume, trust)
        # read before testing: loading the best checkpoint restores the callback's state
        validated = dict(trainer.callback_metrics)
        saved = {k: checkpoint_path(trainer, f"{k}_model_path") for k in ("best", "last")}
        best, pruned_at = best_score(trainer), pruned_step(trainer)
        tested = {}
        if cfg.get("test") and pruned_at is None:
            checkpoint = saved["best"] if training else cfg.get("ckpt_path")
            tested = final_test(trainer, parts, checkpoint, training, trust)
    return Fitted({**metrics_dict(validated), **metrics_dict(tested)}, best, saved, pruned_at)


def fit_from(
    cfg: DictConfig, parts: Components, trainer: L.Trainer, resume: Resume, trust: bool
) -> None:
    """``trainer.fit``, resuming ``cfg.ckpt_path``: stopped by a signal, the account of it
    (``interrupted``, ``last.ckpt`` saved); a checkpoint already at the trainer's limits
    said so (``nothing_left_to_train``)."""
    try:
        trainer.fit(
            parts.task,
            datamodule=parts.datamodule,
            ckpt_path=cfg.get("ckpt_path"),
            weights_only=not trust,
        )
    except SIGTERMException:  # SIGTERM or Ctrl+C: last.ckpt is saved
        raise interrupted(trainer, job_overrides(), sweep_resume()) from None
    step = resume.checkpoint.step if resume.checkpoint is not None else None
    if step is not None and trainer.global_step == step:
        say(nothing_left_to_train(cfg, step))


def pruned_step(trainer: L.Trainer) -> int | None:
    """The global step an Optuna pruner stopped this run at, or None."""
    steps = [getattr(c, "pruned_at", None) for c in trainer.callbacks]
    return next((s for s in steps if s is not None), None)


def nothing_left_to_train(cfg: DictConfig, step: int) -> str:
    """What a resumed run that trained no step says: its checkpoint had already reached
    the trainer's limits (a finished run, resumed without raising them)."""
    if cfg.trainer.get("max_tokens") is not None:  # the budget set the steps
        limits, raise_ = f"max_tokens={cfg.trainer.max_tokens}", "trainer.max_tokens"
    else:
        limits = f"max_epochs={cfg.trainer.max_epochs}, max_steps={cfg.trainer.max_steps}"
        raise_ = "trainer.max_epochs or trainer.max_steps"
    return (
        f"nothing left to train: {cfg.ckpt_path} is at global step {step}, where the "
        f"trainer's {limits} end the run; raise {raise_} to train further (no new "
        "last.ckpt is written)"
    )


def final_test(
    trainer: L.Trainer, parts: Components, checkpoint: str | None, trained: bool, trust: bool
) -> dict[str, Any]:
    """The test metrics of ``checkpoint`` (None: the weights in memory) as the trainer
    gives them, or none when the data has no test split (the run then ends with its
    validation metrics)."""
    datamodule = parts.datamodule
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
        tested = trainer.test(
            parts.task, datamodule=datamodule, ckpt_path=checkpoint, weights_only=not trust
        )
    except SIGTERMException:
        raise interrupted_testing(trainer, checkpoint) from None
    return tested[0] if tested else {}


def signal_name(trainer: L.Trainer) -> str:
    """The signal that stopped the run (Lightning's own handler knows only SIGTERM)."""
    by = next((c.received for c in trainer.callbacks if isinstance(c, StopOnSignal)), None)
    return by or "SIGTERM"


def interrupted(
    trainer: L.Trainer, overrides: Sequence[str] = (), sweep: Sequence[str] | None = None
) -> Interrupted:
    """The entry point's account of a training run stopped by a signal, with the command
    that resumes it: the run's ``overrides`` and the saved ``last.ckpt``; for a job of a
    sweep, the command that finishes its sweep (``sweep``, from ``run.job``), in which
    the job resumes from its ``last.ckpt``."""
    name = signal_name(trainer)
    callback = trainer.checkpoint_callback
    last = getattr(callback, "last_model_path", "") or None
    best = getattr(callback, "best_model_path", "") or None
    score = getattr(callback, "best_model_score", None)
    best_score = None if score is None else float(score)
    if last is None:
        message = f"stopped by {name} at global step {trainer.global_step}: nothing saved"
        return Interrupted(message, name, None, best, best_score)
    stopped = f"stopped by {name} at global step {trainer.global_step}: saved {last}"
    if sweep is not None:
        message = f"{stopped}; {' '.join(sweep)}"
        return Interrupted(message, name, last, best, best_score)
    kept = [o for o in overrides if override_key(o) != "ckpt_path"]
    again = " ".join(shlex.quote(o) for o in [*kept, f"ckpt_path={last}"])
    message = f"{stopped}; resume with tlab-train {again}"
    return Interrupted(message, name, last, best, best_score)


def interrupted_testing(trainer: L.Trainer, checkpoint: str | None) -> Interrupted:
    """The account of a signal during the test that follows training, with the command
    that tests ``checkpoint`` (the one being tested) again."""
    name = signal_name(trainer)
    then = (
        f"test it again with tlab-eval ckpt_path={checkpoint} split=test"
        if checkpoint
        else "the weights under test were not saved"
    )
    return Interrupted(f"stopped by {name} while testing: {then}", name, checkpoint)


def checkpoint_path(trainer: L.Trainer, which: str) -> str | None:
    """``best_model_path`` or ``last_model_path`` of the checkpoint callback, if saved: a
    path the callback names but never wrote (``debug=fdr``, whose fast_dev_run saves
    nothing, still sets ``last_model_path``) is None."""
    callback = trainer.checkpoint_callback
    path = getattr(callback, which, "") if callback is not None else ""
    if path and "://" not in path and not Path(path).exists():  # a file, or a sharded folder
        return None
    return path or None


def best_score(trainer: L.Trainer) -> float | None:
    """The best value of the monitored metric, as the checkpoint callback saw it."""
    score = getattr(trainer.checkpoint_callback, "best_model_score", None)
    return None if score is None else float(score)
