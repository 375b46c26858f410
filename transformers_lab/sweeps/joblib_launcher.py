"""The joblib launcher (``launcher=joblib``): Hydra's, with a sweep that stops as a whole.

Hydra's joblib launcher runs the jobs in loky worker processes. SIGTERM to its main
process (``timeout``, ``make``, ``kill PID``) killed that process alone: the workers went
on training, orphaned, and a resume started then ran a job twice at once in one dir.
Here, on SIGTERM or SIGINT, the main process:

- writes ``STOPPED`` into the sweep dir: a job that starts after it does not run (it
  leaves no record, so the sweep's resume runs it);
- sends SIGTERM to every worker: its job saves ``last.ckpt`` after the current batch and
  records itself interrupted, as a job stopped alone does (a worker notes a signal at any
  moment of its job, ``run.safety.note_signals``);
- waits for them, prints the line that finishes the sweep, and exits with 128 + the
  signal's number, the shell's convention.

A second Ctrl+C stops at once (joblib kills the workers). A job stopped alone (its worker
signalled) does not end the sweep: the other jobs go on, and the main process prints the
line that finishes the sweep after them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from transformers_lab.files import atomic_write
from transformers_lab.run.common import say
from transformers_lab.run.job import sweep_resume
from transformers_lab.run.record import read_record
from transformers_lab.run.safety import StopOnSignal, clear_noted_signal, note_signals

log = logging.getLogger(__name__)

JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
STOP_FILE = "STOPPED"  # in the sweep dir while a stopped sweep's jobs wind down
STOPPED_BY_SIGNAL = {128 + signum for signum in StopOnSignal.SIGNALS}  # Interrupted's codes


class WorkerJob:
    """The task function as a worker process runs it: signals noted from the job's start
    (the main process forwards a stop at any moment), no start once the sweep is
    stopped, and a job stopped by a signal returned as NaN to the launcher (its record
    says interrupted) instead of ending the worker, so that the other jobs' results come
    back."""

    def __init__(self, task_function: TaskFunction) -> None:
        self.task_function = task_function

    def __call__(self, cfg: DictConfig) -> Any:
        note_signals()
        clear_noted_signal()
        stop = Path(str(HydraConfig.get().sweep.dir)) / STOP_FILE
        if stop.is_file():
            say(f"not started: the sweep was stopped ({stop.read_text().strip()})")
            return math.nan
        try:
            return self.task_function(cfg)
        except SystemExit as exc:
            if exc.code in STOPPED_BY_SIGNAL:  # saved, recorded and said by the job
                return math.nan
            raise


class JoblibLauncher(Launcher):
    """Hydra's joblib launcher (held as Hydra's plugins loaded it), whose sweep stops as a
    whole on SIGTERM or SIGINT to its main process."""

    def __init__(self, **kwargs: Any) -> None:
        joblib = Plugins.instance().class_name_to_class[JOBLIB]
        self.joblib = joblib(**kwargs)
        self.config: DictConfig | None = None
        self.received: str | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        worker_job = WorkerJob(task_function)
        self.joblib.setup(hydra_context=hydra_context, task_function=worker_job, config=config)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.config is not None
        stop = Path(str(self.config.hydra.sweep.dir)) / STOP_FILE
        stop.unlink(missing_ok=True)  # a stopped sweep's, now resumed
        self.received = None
        handlers = {s: signal.signal(s, self.on_signal) for s in StopOnSignal.SIGNALS}
        try:
            runs = self.joblib.launch(job_overrides, initial_job_idx)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            stop.unlink(missing_ok=True)
        statuses = [job_status(run) for run in runs]
        stopped = statuses.count("interrupted")
        resumes = "its stopped jobs resume from their last.ckpt"
        resume = " ".join(sweep_resume(self.config.hydra, resumes) or ())
        if self.received is not None:
            unstarted = statuses.count(None)
            say(
                f"sweep stopped by {self.received}: {stopped} running job(s) saved their "
                f"checkpoints, {unstarted} did not start; {resume}",
                file=sys.stderr,
            )
            raise SystemExit(128 + getattr(signal, self.received))
        if stopped:
            say(f"{stopped} job(s) of this sweep were stopped by a signal; {resume}")
        return runs

    def on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: at once
        if self.received is not None:
            return
        self.received = name
        assert self.config is not None
        atomic_write(Path(str(self.config.hydra.sweep.dir)) / STOP_FILE, name + "\n")
        again = "; Ctrl+C again stops at once" if signum == signal.SIGINT else ""
        log.warning("%s: stopping the sweep's running jobs after their batch%s", name, again)
        for worker in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(worker.pid, signal.SIGTERM)


def job_status(run: JobReturn) -> str | None:
    """The status a job recorded in its ``result.json``, or None for one that never ran."""
    output_dir = run.hydra_cfg.hydra.runtime.output_dir if run.hydra_cfg else None
    record = read_record(Path(output_dir)) if output_dir else None
    return None if record is None else record.status
