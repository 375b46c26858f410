"""The trainer of a run, with its callbacks and loggers: one builder for fitting,
evaluating and scoring at other lengths (``build_trainer``); Lightning's refusals as one
line (``lightning_refusals``); the W&B run of a fit named (``name_wandb_run``: its id
kept across a resume), given the config (``log_hyperparameters``) and finished."""

from __future__ import annotations

import contextlib
import logging
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf, open_dict

from transformers_lab.config import instantiation_refusals
from transformers_lab.errors import ConfigError
from transformers_lab.files import atomic_write
from transformers_lab.run.budget import TOKEN_KEYS
from transformers_lab.run.checkpoints.saved import WANDB_ID
from transformers_lab.run.overrides import (
    SEED_KEYS,
    in_multirun,
    job_overrides,
    override_key,
    sweep_parameters,
)

log = logging.getLogger(__name__)


class NoTips(logging.Filter):
    """Lightning's advertisement, printed at every run (``💡 Tip: ...litlogger...``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_known_noise() -> None:
    """Silence what Lightning says at every run that tells a researcher nothing: its tip
    (a log line), and the FutureWarning that its own code raises through torch's
    deprecated ``LeafSpec`` (Lightning 2.6 on torch 2.10+; its message names the class,
    so nothing else is hidden). Idempotent."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
    )
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, NoTips) for f in rank_zero.filters):
        rank_zero.addFilter(NoTips())


def build_trainer(
    cfg: DictConfig,
    callbacks: Sequence[L.Callback] = (),
    purpose: str = "fit",
    task: Any = None,
    resumed: Any = None,
    **options: Any,
) -> L.Trainer:
    """The trainer of ``cfg.trainer``, the one builder for every purpose:
    - ``fit``: with the run's callbacks and loggers and the caller's ``callbacks`` (a
      study's pruning callback: ``sweeps.pruning``, which this package does not import);
      its W&B run named, and the one of the checkpoint it ``resumed`` (a
      ``SavedCheckpoint``) continued (``name_wandb_run``);
    - ``evaluate``: with the run's loggers, no callbacks (``tlab-eval``);
    - ``score``: one evaluation among many (a length), no logger, checkpoint, bar or
      summary.
    ``options`` override more of its arguments (one device, after a DDP fit). Lightning's
    refusal of a setting is a ``ConfigError`` (``lightning_refusals``). Given the ``task``
    it will fit, its loggers get the whole config and the parameter counts."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    quiet_known_noise()
    extra: dict[str, Any] = {}
    if cfg.trainer.get("profiler") is None:
        extra["profiler"] = NoProfiler()
    if purpose == "score":
        extra.update(logger=False, callbacks=[], enable_checkpointing=False)
        extra.update(enable_progress_bar=False, enable_model_summary=False)
    elif purpose == "evaluate":
        extra.update(logger=build_loggers(cfg.get("logger")) or False)
    else:
        name_wandb_run(cfg, resumed)
        loggers = build_loggers(cfg.get("logger"))
        progress_bar = cfg.trainer.get("enable_progress_bar", True)
        built = build_callbacks(cfg.get("callbacks"), bool(loggers), progress_bar)
        built.extend(callbacks)
        # without our ModelCheckpoint, Lightning would otherwise add a default one
        checkpointing = any(isinstance(c, ModelCheckpoint) for c in built)
        extra.update(callbacks=built, logger=loggers or False, enable_checkpointing=checkpointing)
    lightning_options = {k: v for k, v in cfg.trainer.items() if k not in TOKEN_KEYS}
    with lightning_refusals(), instantiation_refusals("trainer"):
        trainer = instantiate(OmegaConf.create(lightning_options), **{**extra, **options})
    if task is not None:
        log_hyperparameters(cfg, task, trainer)
    return trainer


PURPOSES = ("fit", "evaluate", "score")


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


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler, which profiles nothing, without its cost: the trainer
    enters ``profile()`` about 150 times a training step (once per callback and hook), and
    Lightning's is a generator-based context manager, a few microseconds each; this one
    hands back one shared no-op context."""

    _NOTHING = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        return self._NOTHING


def build_callbacks(
    config: DictConfig | None, with_logger: bool = True, progress_bar: bool = True
) -> list[Callback]:
    """The callbacks of the ``callbacks`` group (null entries are switched off); the
    learning-rate monitor is left out without a logger, the bar when the trainer has none."""
    callbacks = []
    for name, node in (config or {}).items():
        if node is None:
            continue
        with instantiation_refusals(f"callbacks.{name}"):
            callback = instantiate(node)
        if isinstance(callback, LearningRateMonitor) and not with_logger:
            log.info("no logger: the learning-rate monitor is left out")
        elif not (isinstance(callback, ProgressBar) and not progress_bar):
            callbacks.append(callback)
    return callbacks


def build_loggers(config: DictConfig | None) -> list[Logger]:
    """The loggers of the ``logger`` group (null entries are switched off)."""
    loggers = []
    for name, node in (config or {}).items():
        if node is not None:
            with instantiation_refusals(f"logger.{name}"):
                loggers.append(instantiate(node))
    return loggers


def name_wandb_run(cfg: DictConfig, checkpoint: Any = None) -> None:
    """Fill the wandb logger's settings left null: in a multirun, one group for the whole
    sweep (its directory's name), a job_type per swept choice, seeds aside, and a name
    with every swept setting, seeds included; otherwise the run name and the task name.
    Its id is the job's (``wandb_run_id``), with ``resume="allow"``: a job resumed from
    its ``checkpoint`` (a ``SavedCheckpoint``) goes on in the same wandb run, not a
    second one."""
    node = (cfg.get("logger") or {}).get("wandb")
    if node is None:
        return
    group, job_type, name = cfg.run_name, cfg.task_name, node.get("name")
    if in_multirun():
        sweep_dir = Path(cfg.paths.output_dir).parent
        group = f"{cfg.task_name}-{sweep_dir.name}"
        swept = sweep_parameters(sweep_dir)
        settings = [o for o in job_overrides() if override_key(o) in swept]
        choice = [o for o in settings if override_key(o) not in SEED_KEYS]
        job_type = " ".join(choice)[:64] or cfg.task_name
        name = " ".join([name or cfg.run_name, *settings])[:128]
    with open_dict(node):
        node.group = node.get("group") or group
        node.job_type = node.get("job_type") or job_type
        node.name = name
        node.id = node.get("id") or wandb_run_id(cfg, checkpoint)
        node.resume = node.get("resume") or "allow"


def wandb_run_id(cfg: DictConfig, checkpoint: Any = None) -> str:
    """The wandb run id of this job: a resumed job's is the one its ``checkpoint``'s run
    dir recorded (``SavedCheckpoint.wandb_id``), a new job's a fresh random one (a fresh
    run in a reused dir is a new wandb run); written to the run dir, so a resume of this
    run finds it in turn."""
    out = Path(cfg.paths.output_dir)
    run_id = (checkpoint.wandb_id if checkpoint is not None else None) or uuid.uuid4().hex[:16]
    if rank_zero_only.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / WANDB_ID, run_id + "\n")
    return run_id


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
