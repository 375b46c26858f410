"""The job's side of an Optuna study: report the study's objective after every validation
and stop when the study's pruner says so.

The study sweeper (``sweeps.optuna_sweeper``) gives each job its trial number as
``trial=<n>``; the job finds the study through the sweeper's settings in its Hydra
config (``hydra.sweeper.storage`` and ``study_name``) and builds the same pruner from
``cfg.pruner``. A pruned job ends as a finished one does, its checkpoints saved, and is
recorded as ``pruned``.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import optuna
from hydra.utils import instantiate
from omegaconf import DictConfig

from transformers_lab.errors import ConfigError

log = logging.getLogger(__name__)


class TrialPruning(L.Callback):
    """Report ``monitor`` (the study's objective) to an Optuna trial after each validation
    (its step: the global step) and stop training once the trial should be pruned. A
    validation that does not log it is said once: the pruner then never sees this trial."""

    def __init__(self, trial: optuna.Trial, monitor: str) -> None:
        self.trial = trial
        self.monitor = monitor
        self.pruned_at: int | None = None  # the global step it was pruned at
        self.missing_said = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.pruned_at is not None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self.missing_said:
                self.missing_said = True
                logged = ", ".join(sorted(trainer.callback_metrics)) or "none"
                log.warning(
                    "trial %d: the study's objective %s is not logged at validation (logged: "
                    "%s), so the pruner cannot judge this trial",
                    self.trial.number,
                    self.monitor,
                    logged,
                )
            return
        step = trainer.global_step
        self.trial.report(float(value), step=step)
        if self.trial.should_prune():
            self.pruned_at = step
            log.info(
                "trial %d pruned at step %d (%s %.4g)",
                self.trial.number,
                step,
                self.monitor,
                float(value),
            )
            print(f"pruned: trial {self.trial.number} at step {step}", flush=True)
            trainer.should_stop = True

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The trial in the wandb run's summary: its number, and pruned or finished."""
        from lightning.pytorch.loggers import WandbLogger

        state = "finished" if self.pruned_at is None else "pruned"
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                summary = logger.experiment.summary
                summary["trial/number"] = self.trial.number
                summary["trial/state"] = state
                if self.pruned_at is not None:
                    summary["trial/pruned_at"] = self.pruned_at

    def state_dict(self) -> dict[str, Any]:
        return {"pruned_at": self.pruned_at}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned_at = state_dict.get("pruned_at")


def pruning_callback(cfg: DictConfig) -> TrialPruning | None:
    """The pruning callback of a job that is a study's trial with a pruner, else None."""
    number = cfg.get("trial")
    pruner_cfg = cfg.get("pruner")
    if number is None or not pruner_cfg:
        return None
    from transformers_lab.run.overrides import hydra_config
    from transformers_lab.sweeps.storage import open_storage

    hydra_cfg = hydra_config()
    sweeper = hydra_cfg.sweeper if hydra_cfg is not None else None
    if sweeper is None or "study_name" not in sweeper:
        raise ConfigError(
            f"trial={number} is set by the study sweeper (sweep=lr_optuna, "
            "hydra/sweeper=optuna); a run of its own has no study to report to: leave trial unset"
        )
    storage = open_storage(str(sweeper.storage))
    pruner = instantiate(pruner_cfg)
    study = optuna.load_study(study_name=str(sweeper.study_name), storage=storage, pruner=pruner)
    if len(study.directions) > 1:  # Optuna prunes single-objective studies only
        return None
    trial = next((t for t in study.get_trials(deepcopy=False) if t.number == int(number)), None)
    if trial is None:
        raise ConfigError(f"study {sweeper.study_name!r} has no trial {number}")
    # the value the study ranks trials by (and its pruner compares): the objective
    objectives = list(sweeper.get("objectives") or [])
    metric = str(objectives[0]) if objectives else str(cfg.monitor.metric)
    return TrialPruning(optuna.Trial(study, trial._trial_id), metric)
