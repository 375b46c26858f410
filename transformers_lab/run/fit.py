"""One run, fit and tested as its config says (``fit_and_test``), a line a step as a run
takes them: the config checked (``preflight``), the checkpoint to resume read once and held
to it (``checkpoints``), W&B named (``loggers``), data, model and task built
(``components``), the trainer (``trainer``), fit, test and the evaluation past the trained
length (``lengths``), and its ``Outcome`` (``record``) with what its seed fixed
(``seeded``). ``tlab-train`` runs it as a job (``run.job``), which reads the checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig

from transformers_lab.models import GPT, EncoderClassifier
from transformers_lab.run.callbacks.safety import StopOnSignal
from transformers_lab.run.checkpoints import (
    SavedCheckpoint,
    check_resume,
    check_weights,
    read_checkpoint,
    resolved_sections,
)
from transformers_lab.run.components import Components, build_components
from transformers_lab.run.lengths import LengthOptions, score_lengths
from transformers_lab.run.loggers import finish_wandb, log_hyperparameters, name_wandb_run
from transformers_lab.run.overrides import job_overrides, override_key, sweep_resume
from transformers_lab.run.preflight import check_config
from transformers_lab.run.record import Interrupted, Outcome, metrics_dict, print_metrics, say
from transformers_lab.run.trainer import build_trainer, lightning_refusals, use_cpu

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
    a study's pruning callback, ``sweeps.pruning``). Everything that can be refused is
    refused before any data is read: the config, and the checkpoint's config against it."""
    say(f"run dir: {cfg.paths.output_dir}")
    lengths = check_config(cfg)
    run_config = resolved_sections(cfg)  # model, data and task, as every checkpoint keeps them
    checkpoint, changed = resume(cfg, checkpoint, run_config)
    name_wandb_run(cfg, checkpoint)
    use_cpu(cfg)
    L.seed_everything(cfg.seed, workers=True)
    parts = build_components(cfg, checkpoint, run_config)
    if checkpoint is not None:  # and its tensors fit (a checkpoint with no saved config)
        check_weights(checkpoint, parts.task, changed)
    trainer = build_trainer(cfg, callbacks)
    start = seeded(parts.model, run_config.get("data"))  # what the seed fixed, for pairing
    log.info("model %s: %s parameters", type(parts.model).__name__, f"{parts.task.num_params:,}")
    if parts.compiled:
        say(parts.compiled)
    try:
        fitted = fit_and_score(cfg, parts, trainer, checkpoint, lengths)
    finally:
        finish_wandb(trainer)
    report(fitted.metrics, fitted.checkpoints)
    model, task = parts.model, parts.task
    state = model.state_size() if isinstance(model, GPT | EncoderClassifier) else None
    return Outcome(**fitted._asdict(), params=task.num_params, state_size=state, seeded=start,
                   layers=task.layers)  # fmt: skip


def resume(
    cfg: DictConfig, checkpoint: SavedCheckpoint | None, run_config: dict[str, Any]
) -> tuple[SavedCheckpoint | None, list[str]]:
    """The checkpoint to resume (read once, here if the job has not: ``trust_checkpoint``
    lets it hold more than tensors and plain values) held to the run's model, data and
    task config, and the changes ``resume_may_change`` allowed; (None, []) without one."""
    if not cfg.get("ckpt_path"):
        return None, []
    if checkpoint is None:
        checkpoint = read_checkpoint(cfg.ckpt_path, bool(cfg.get("trust_checkpoint")))
    may_change = cfg.get("resume_may_change") or ()
    return checkpoint, check_resume(checkpoint, run_config, may_change)


def fit_and_score(
    cfg: DictConfig,
    parts: Components,
    trainer: L.Trainer,
    checkpoint: SavedCheckpoint | None,
    lengths: LengthOptions | None,
) -> Fitted:
    """Fit (unless ``train=false``), test (``test=true``) and score at other lengths."""
    trust = bool(cfg.get("trust_checkpoint"))
    with lightning_refusals():
        log_hyperparameters(cfg, parts.task, trainer)
        training = cfg.get("train", True)
        if training:
            try:
                trainer.fit(
                    parts.task,
                    datamodule=parts.datamodule,
                    ckpt_path=cfg.get("ckpt_path"),
                    weights_only=not trust,
                )
            except SIGTERMException:  # SIGTERM or Ctrl+C: last.ckpt is saved
                raise interrupted(trainer, job_overrides(), sweep_resume()) from None
            if checkpoint is not None and trainer.global_step == checkpoint.step:
                say(nothing_left_to_train(cfg, checkpoint.step))
        metrics = metrics_dict(trainer.callback_metrics)
        # read before testing: loading the best checkpoint restores the callback's state
        saved = {k: checkpoint_path(trainer, f"{k}_model_path") for k in ("best", "last")}
        best, pruned_at = best_score(trainer), pruned_step(trainer)
        # without training, the checkpoint given (else the model as built); a pruned
        # trial is not worth a test
        if cfg.get("test") and pruned_at is None:
            tested = saved["best"] if training else cfg.get("ckpt_path")
            metrics.update(final_test(trainer, parts, tested, training, trust))
        if lengths and pruned_at is None and trainer.global_rank == 0:  # past the trained length
            scored = saved["best"] or saved["last"] or cfg.get("ckpt_path")
            if scored is None:
                say("eval_lengths: the run saved no checkpoint to score at other lengths")
            else:
                given = checkpoint is not None and Path(scored) == checkpoint.path
                read = checkpoint if given else read_checkpoint(scored, trust)
                metrics.update(score_lengths(cfg, read, lengths))
    return Fitted(metrics, best, saved, pruned_at)


class Fitted(NamedTuple):
    """What fitting, testing and scoring gave: the final metrics, the monitored metric's
    best value, the best and last checkpoints, the step a pruner stopped it at."""

    metrics: dict[str, float]
    best: float | None
    checkpoints: dict[str, str | None]
    pruned_at: int | None


def pruned_step(trainer: L.Trainer) -> int | None:
    """The global step an Optuna pruner stopped this run at, or None."""
    steps = [getattr(c, "pruned_at", None) for c in trainer.callbacks]
    return next((s for s in steps if s is not None), None)


def nothing_left_to_train(cfg: DictConfig, step: int) -> str:
    """What a resumed run that trained no step says: its checkpoint had already reached
    the trainer's limits (a finished run, resumed without raising them)."""
    limits = f"max_epochs={cfg.trainer.max_epochs}, max_steps={cfg.trainer.max_steps}"
    return (
        f"nothing left to train: {cfg.ckpt_path} is at global step {step}, where the "
        f"trainer's {limits} end the run; raise trainer.max_epochs or trainer.max_steps to "
        "train further (no new last.ckpt is written)"
    )


def final_test(
    trainer: L.Trainer, parts: Components, checkpoint: str | None, trained: bool, trust: bool
) -> dict[str, float]:
    """The test metrics of ``checkpoint`` (None: the weights in memory), or none when the
    data has no test split (the run then ends with its validation metrics)."""
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
    return metrics_dict(tested[0] if tested else {})


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


def digest(data: bytes) -> str:
    """A short fingerprint of some bytes (12 hex digits of SHA-1)."""
    return hashlib.sha1(data).hexdigest()[:12]


def seeded(model: Any, data_config: Any) -> dict[str, Any]:
    """What a run's seed fixed before training, so that a summary pairs two runs by seed
    only where the seed made them alike: the data (its resolved config: every data
    module is generated or split from its own config), torch's random state once the
    model is built (the order of the training batches is drawn from it), and each
    parameter's initial values, by name. A kernel with parameters of its own (Based's
    projections) draws them between the layers' and shifts everything drawn after."""
    import torch

    params = {
        name: digest(p.detach().cpu().float().contiguous().numpy().tobytes())
        for name, p in model.named_parameters()
    }
    return {
        "data": digest(json.dumps(data_config, sort_keys=True, default=str).encode()),
        "rng": digest(torch.get_rng_state().numpy().tobytes()),
        "params": params,
    }


def report(metrics: dict[str, float], checkpoints: dict[str, str | None]) -> None:
    print_metrics(metrics)
    say(f"best checkpoint: {checkpoints['best']}", f"last checkpoint: {checkpoints['last']}")


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
