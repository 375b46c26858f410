"""One run, fit and tested as its config says (``fit_and_test``): check the config,
build data, model, task and trainer, resume where a checkpoint is given, fit, test, and
return its ``Outcome`` with what its seed fixed (``seeded``); what the run prints
(``say``, ``report``), and its account of a stop by a signal (``Interrupted``, worded by
``interrupted``). ``tlab-train`` runs it as a job (``run.job``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig

from transformers_lab.errors import ConfigError, RunStopped
from transformers_lab.models import GPT, EncoderClassifier
from transformers_lab.run.build import (
    build_datamodule,
    build_model,
    build_task,
    build_trainer,
    compile_model,
    use_cpu,
)
from transformers_lab.run.callbacks.safety import StopOnSignal
from transformers_lab.run.checkpoints import (
    check_checkpoint,
    check_resume,
    load_checkpoint,
    resolved_sections,
)
from transformers_lab.run.lengths import score_lengths
from transformers_lab.run.loggers import finish_wandb, log_hyperparameters, name_wandb_run
from transformers_lab.run.overrides import job_overrides, override_key, sweep_resume
from transformers_lab.run.preflight import check_config
from transformers_lab.run.record import Outcome

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit and test as ``cfg`` says; return the final metrics (validation, then test)."""
    return fit_and_test(cfg).metrics


def fit_and_test(cfg: DictConfig, callbacks: Sequence[L.Callback] = ()) -> Outcome:
    """Fit and test as ``cfg`` says; ``callbacks`` join the trainer's (the caller's: a
    study's pruning callback, ``sweeps.pruning``).

    In order: the config is checked and the run built on the meta device (``preflight``);
    a checkpoint to resume is read and its config held to this one, before any data is
    read; data, model, task and trainer are built, the checkpoint's tensors held to the
    task; then fit and test."""
    say(f"run dir: {cfg.paths.output_dir}")
    check_config(cfg)
    name_wandb_run(cfg)  # the wandb logger's settings left null (group, name, id)
    run_config = resolved_sections(cfg)  # model, data and task, as every checkpoint keeps them
    checkpoint, changed = None, []
    if cfg.get("ckpt_path"):  # resuming: the checkpoint's model, data and task config hold
        checkpoint = load_checkpoint(cfg.ckpt_path)
        may_change = cfg.get("resume_may_change") or ()
        changed = check_resume(checkpoint, run_config, cfg.ckpt_path, may_change)
    use_cpu(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = build_datamodule(cfg.data)
    model = build_model(cfg.model, datamodule)
    compiled = compile_model(model) if cfg.get("compile") else None  # its weights as built
    task = build_task(cfg.task, model, datamodule, run_config=run_config)
    with lightning_refusals():
        trainer = build_trainer(cfg, callbacks)
    resumed_step = None
    if checkpoint is not None:  # and its tensors fit (a checkpoint with no saved config)
        check_checkpoint(checkpoint, task, cfg.ckpt_path, changed)
        resumed_step = checkpoint.get("global_step")
        del checkpoint  # Lightning loads it again to restore the run
    start = seeded(model, run_config.get("data"))  # what the seed fixed, for pairing
    log.info("model %s: %s parameters", type(model).__name__, f"{task.num_params:,}")
    if compiled:
        say(compiled)
    try:
        with lightning_refusals():
            log_hyperparameters(cfg, task, trainer)
            training = cfg.get("train", True)
            if training:
                try:
                    trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
                except SIGTERMException:  # SIGTERM or Ctrl+C: last.ckpt is saved
                    raise interrupted(trainer, job_overrides(), sweep_resume()) from None
                if resumed_step is not None and trainer.global_step == resumed_step:
                    say(nothing_left_to_train(cfg, resumed_step))
            metrics = metrics_dict(trainer.callback_metrics)
            # read before testing: loading the best checkpoint restores the callback's state
            checkpoints = {k: checkpoint_path(trainer, f"{k}_model_path") for k in ("best", "last")}
            best = best_score(trainer)
            pruned_at = pruned_step(trainer)
            # without training, the checkpoint given (else the model as built); a pruned
            # trial is not worth a test
            if cfg.get("test") and pruned_at is None:
                tested = checkpoints["best"] if training else cfg.get("ckpt_path")
                metrics.update(final_test(trainer, task, datamodule, tested, training))
            lengths = cfg.get("eval_lengths") and pruned_at is None
            if lengths and trainer.global_rank == 0:  # past the trained length
                scored = checkpoints["best"] or checkpoints["last"] or cfg.get("ckpt_path")
                if scored is None:
                    say("eval_lengths: the run saved no checkpoint to score at other lengths")
                else:
                    metrics.update(score_lengths(cfg, scored))
    finally:
        finish_wandb(trainer)
    report(metrics, checkpoints)
    state = model.state_size() if isinstance(model, GPT | EncoderClassifier) else None
    return Outcome(
        metrics, best, task.num_params, checkpoints, state, pruned_at, start, task.layers
    )


@contextlib.contextmanager
def lightning_refusals() -> Iterator[None]:
    """Lightning's word on a setting that cannot work, as a ``ConfigError``."""
    try:
        yield
    except MisconfigurationException as exc:
        raise ConfigError(f"Lightning refused the run: {exc}") from exc
    except ValueError as exc:  # the same, where Lightning raises a plain ValueError
        if not str(exc).strip().startswith("`val_check_interval`"):
            raise
        raise ConfigError(
            f"Lightning refused the run: {str(exc).strip()} (here: trainer.val_check_interval "
            "within an epoch, a fraction of one such as 0.25, or "
            "trainer.check_val_every_n_epoch=null to count steps across epochs)"
        ) from exc


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


class Interrupted(RunStopped):
    """SIGTERM or SIGINT stopped the run after saving a checkpoint (``checkpoint``); the
    best checkpoint so far and its score are ``best`` and ``best_score``."""

    def __init__(
        self,
        message: str,
        signal_name: str,
        checkpoint: str | None,
        best: str | None = None,
        best_score: float | None = None,
    ) -> None:
        super().__init__(message)
        self.signal_name, self.checkpoint = signal_name, checkpoint
        self.best, self.best_score = best, best_score
        self.exit_code = 128 + getattr(signal, signal_name)  # the shell's convention


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


def metrics_dict(metrics: dict[str, Any]) -> dict[str, float]:
    """Tensor metrics as plain floats, sorted by name."""
    return {k: float(v) for k, v in sorted(metrics.items())}


def say(*lines: str, file: Any = None) -> None:
    """Print on the first process only (under DDP every process runs this script)."""
    if rank_zero_only.rank == 0:
        print(*lines, sep="\n", file=file or sys.stdout, flush=True)


def print_metrics(metrics: dict[str, float]) -> None:
    """The run's last lines: its final metrics, one per line."""
    say("final metrics:", *(f"  {name}: {value:.6g}" for name, value in metrics.items()))


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
