"""Checkpoints written as a researcher expects (``Checkpoint``: ``last.ckpt`` at every
save point and on a signal, the best carried into a resumed run's dir, the fitting time
kept), atomically (``AtomicCheckpointIO``, which also reads them for Lightning's own
restore, as safely as ``load_file``)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from transformers_lab.errors import ConfigError
from transformers_lab.files import atomic_write
from transformers_lab.run.checkpoints.saved import load_file


class Checkpoint(ModelCheckpoint):
    """``ModelCheckpoint`` as a researcher expects it.

    - ``last.ckpt`` is rewritten at every save point. Lightning 2.6 rewrites it only when
      a top-k checkpoint is saved at the same step, so after a validation that was not a
      new best it kept an older state and a resume went back in time.
    - On SIGTERM (and on Ctrl+C, with ``StopOnSignal``) ``last.ckpt`` is saved before the
      run stops. Other exceptions save nothing: the last good checkpoint stays as it was.
    - Resumed into a new run dir, the best checkpoints so far are copied there with their
      scores, so the best is still the best of the whole run (Lightning would forget it).
    - A monitored metric the run does not log is a one-line ``ConfigError`` that lists the
      ones it does: after the sanity check for a ``val/`` metric, before any training, and
      otherwise at the first save (Lightning raises there, with a hint for code authors).
    - Each checkpoint holds the run's fitting time so far, its earlier parts included
      (``time_s``; ``SavedCheckpoint.time_s``), so that a resumed job's wall time counts them.
    """

    TIME = "time_s"
    started: float | None = None  # when this part's fit set up (None: not yet)
    earlier = 0.0  # the fitting time of the parts before it (its checkpoint's)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.started, self.earlier = time.perf_counter(), 0.0

    def state_dict(self) -> dict[str, Any]:
        elapsed = 0.0 if self.started is None else time.perf_counter() - self.started
        return {**super().state_dict(), self.TIME: self.earlier + elapsed}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking and str(self.monitor).startswith("val/"):
            self.check_monitor(self._monitor_candidates(trainer))
        super().on_validation_end(trainer, pl_module)

    def check_monitor(self, metrics: dict[str, Any]) -> None:
        if self.monitor is None or self.monitor in metrics:
            return
        logged = ", ".join(sorted(k for k in metrics if k not in ("epoch", "step"))) or "none"
        raise ConfigError(
            f"monitor.metric={self.monitor} is not a metric this run logs (it logs: {logged}); "
            "set monitor.metric= to one of them"
        )

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        if self.save_top_k:
            self.check_monitor(monitor_candidates)
        super()._save_topk_checkpoint(trainer, monitor_candidates)
        # Lightning's hooks save last.ckpt when a checkpoint was written at this step
        self._last_global_step_saved = trainer.global_step

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not (isinstance(exception, SIGTERMException) and self.save_last):
            return
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if self._last_global_step_saved != trainer.global_step or not self.last_model_path:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.earlier = float(state_dict.get(self.TIME, 0.0))
        old = state_dict.get("dirpath")
        if self.dirpath and old and old != self.dirpath:
            state_dict = self.moved_state(state_dict)
        super().load_state_dict(state_dict)

    def moved_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with its best checkpoints copied into this callback's dirpath."""
        moved = {p: str(Path(self.dirpath) / Path(p).name) for p in state["best_k_models"]}
        moved = {old: new for old, new in moved.items() if Path(old).exists()}
        if rank_zero_only.rank == 0 and moved:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            for old, new in moved.items():  # a file, or a sharded checkpoint's folder
                if Path(old).is_dir():
                    shutil.copytree(old, new, dirs_exist_ok=True)
                else:
                    shutil.copy2(old, new)
        return {
            **state,
            "dirpath": self.dirpath,
            "best_k_models": {moved[p]: s for p, s in state["best_k_models"].items() if p in moved},
            "best_model_path": moved.get(state["best_model_path"], ""),
            "kth_best_model_path": moved.get(state["kth_best_model_path"], ""),
            "last_model_path": "",
        }


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file in its own folder, flush it to disk and
    rename it over the target: a rename within a folder is atomic, so a kill at any moment
    leaves either the old checkpoint or the new one, never a torn file. (Lightning's own
    writer stages the file in the system's temp dir; moved to another file system, that
    is a copy over the target, which a kill can leave half-written.)"""

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        atomic_write(path, lambda f: torch.save(checkpoint, f), sync=True)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's own restore, through ``load_file``: only tensors and plain values
        unless the run trusts the file (``weights_only=False``, ``trust_checkpoint=true``)."""
        return load_file(path, trust=weights_only is False, mmap=False)
