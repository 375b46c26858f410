"""The joblib launcher (``launcher=joblib``): Hydra's, with a sweep that stops as a whole.

Hydra's joblib launcher runs the jobs in loky worker processes. SIGTERM to its main
process (``timeout``, ``make``, ``kill PID``) killed that process alone: the workers went
on training, orphaned, and a resume started then ran a job twice at once in one dir.
Here, on SIGTERM, SIGINT or SIGUSR2 (a SLURM job's warning before its time limit, when the
sweep runs inside one), the main process:

- writes ``STOPPED`` into a folder of its own in the sweep dir: a job that starts after
  it does not run (it leaves no record, so the sweep's resume runs it);
- sends SIGTERM to every worker that runs a job: the job saves ``last.ckpt`` after the
  current batch and records itself interrupted, as a job stopped alone does (a worker
  notes a signal at any moment of its job, ``run.callbacks.safety.note_signals``);
- waits for them, prints the line that finishes the sweep, and exits with 128 + the
  signal's number, the shell's convention.

A second signal stops at once (joblib kills the workers). A job stopped alone (its worker
signalled) does not end the sweep: the other jobs go on, and the main process prints the
line that finishes the sweep after them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import shutil
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from transformers_lab.files import atomic_write
from transformers_lab.run.callbacks.safety import StopOnSignal, clear_noted_signal, note_signals
from transformers_lab.run.overrides import sweep_resume
from transformers_lab.run.record import read_record, say

log = logging.getLogger(__name__)

JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
STOP_FILE = "STOPPED"  # in the launcher's folder while a stopped sweep's jobs wind down
STOPPED_BY_SIGNAL = {128 + signum for signum in StopOnSignal.SIGNALS}  # Interrupted's codes


class WorkerJob:
    """The task function as a worker process runs it: signals noted from the job's start
    (the main process forwards a stop at any moment), the worker listed as running a job
    (``<folder>/running/<pid>``: only those are signalled), no start once the sweep is
    stopped (``<folder>/STOPPED``), and a job stopped by a signal returned as NaN to the
    launcher (its record says interrupted) instead of ending the worker, so that the
    other jobs' results come back. ``folder`` is its launcher's own: several processes
    may share one sweep dir (an Optuna study's workers)."""

    def __init__(self, task_function: TaskFunction, folder: str) -> None:
        self.task_function, self.folder = task_function, Path(folder)

    def __call__(self, cfg: DictConfig) -> Any:
        note_signals()
        clear_noted_signal()
        listed = self.folder / "running" / str(os.getpid())
        listed.parent.mkdir(parents=True, exist_ok=True)
        listed.touch()  # before the check: a stop after it finds this worker listed
        try:
            if (self.folder / STOP_FILE).is_file():
                why = (self.folder / STOP_FILE).read_text().strip()
                say(f"not started: the sweep was stopped ({why})")
                return math.nan
            try:
                return self.task_function(cfg)
            except SystemExit as exc:
                if exc.code in STOPPED_BY_SIGNAL:  # saved, recorded and said by the job
                    return math.nan
                raise
        finally:
            listed.unlink(missing_ok=True)


class JoblibLauncher(Launcher):
    """Hydra's joblib launcher (held as Hydra's plugins loaded it), whose sweep stops as a
    whole on SIGTERM, SIGINT or SIGUSR2 to its main process; a second signal stops at once."""

    def __init__(self, **kwargs: Any) -> None:
        joblib = Plugins.instance().class_name_to_class[JOBLIB]
        self.joblib = joblib(**kwargs)
        self.config: DictConfig | None = None
        self.folder: Path | None = None
        self.received: str | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        # this process's, in the sweep dir: its workers' list and its stop
        own = f".launcher-{socket.gethostname()}-{os.getpid()}"
        self.folder = Path(str(config.hydra.sweep.dir)).resolve() / own
        worker_job = WorkerJob(task_function, str(self.folder))
        self.joblib.setup(hydra_context=hydra_context, task_function=worker_job, config=config)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.config is not None and self.folder is not None
        shutil.rmtree(self.folder, ignore_errors=True)
        (self.folder / "running").mkdir(parents=True)
        self.received = None
        handlers = {s: signal.signal(s, self.on_signal) for s in StopOnSignal.SIGNALS}
        try:
            runs = self.joblib.launch(job_overrides, initial_job_idx)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            shutil.rmtree(self.folder, ignore_errors=True)
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
        if self.received is not None:
            raise KeyboardInterrupt  # a second signal: at once (joblib ends the workers)
        self.received = name
        assert self.folder is not None
        atomic_write(self.folder / STOP_FILE, name + "\n")
        log.warning(
            "%s: stopping the sweep's running jobs after their batch; a second signal stops "
            "at once",
            name,
        )
        # the workers that run a job (one that has not started one has no handler yet, and
        # would die of it: loky would then kill the others before they saved)
        ours = {p.pid for p in multiprocessing.active_children()}
        for listed in (self.folder / "running").iterdir():
            pid = int(listed.name)
            if pid in ours:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, signal.SIGTERM)


def job_status(run: JobReturn) -> str | None:
    """The status a job recorded in its ``result.json``, or None for one that never ran."""
    output_dir = run.hydra_cfg.hydra.runtime.output_dir if run.hydra_cfg else None
    record = read_record(Path(output_dir)) if output_dir else None
    return None if record is None else record.status
