"""The run's Lightning callbacks, in one home: those that keep a run safe (``safety``: the
NaN guard, stopping on a signal, exact resume) and those that show it (``views``: the
progress bar, the final validation, pictures); the checkpoint callback is
``run.checkpoints``'. ``build_callbacks`` builds the ``callbacks`` group's."""

from __future__ import annotations

import logging

from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ProgressBar
from omegaconf import DictConfig

from transformers_lab.config import call

log = logging.getLogger(__name__)


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
