"""The trainer of a run, with its callbacks and loggers: one builder for fitting,
evaluating and scoring at other lengths (``build_trainer``); Lightning's refusals as one
line (``lightning_refusals``)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import Logger
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from transformers_lab.errors import ConfigError
from transformers_lab.run.components import call
from transformers_lab.run.loggers import log_hyperparameters

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
    **options: Any,
) -> L.Trainer:
    """The trainer of ``cfg.trainer``, the one builder for every purpose:
    - ``fit``: with the run's callbacks and loggers and the caller's ``callbacks`` (a
      study's pruning callback: ``sweeps.pruning``, which this package does not import);
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
        loggers = build_loggers(cfg.get("logger"))
        progress_bar = cfg.trainer.get("enable_progress_bar", True)
        built = build_callbacks(cfg.get("callbacks"), bool(loggers), progress_bar)
        built.extend(callbacks)
        # without our ModelCheckpoint, Lightning would otherwise add a default one
        checkpointing = any(isinstance(c, ModelCheckpoint) for c in built)
        extra.update(callbacks=built, logger=loggers or False, enable_checkpointing=checkpointing)
    with lightning_refusals():
        trainer = call(cfg.trainer, "trainer", **{**extra, **options})
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
        callback = call(node, f"callbacks.{name}")
        if isinstance(callback, LearningRateMonitor) and not with_logger:
            log.info("no logger: the learning-rate monitor is left out")
        elif not (isinstance(callback, ProgressBar) and not progress_bar):
            callbacks.append(callback)
    return callbacks


def build_loggers(config: DictConfig | None) -> list[Logger]:
    """The loggers of the ``logger`` group (null entries are switched off)."""
    return [
        call(node, f"logger.{name}") for name, node in (config or {}).items() if node is not None
    ]
