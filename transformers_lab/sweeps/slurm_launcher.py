"""The SLURM launcher (``launcher=slurm``): each job of a multirun one task of a SLURM job
array, submitted through submitit, and a sweep that comes through what clusters do to
jobs: cancels, preemptions, requeues and time limits.

Before it submits, it checks what would otherwise fail as a traceback or a job that never
starts, and says each in one line: ``sbatch`` must be found, the partition must be the
cluster's, and the time limit must be minutes or SLURM's own form (``4:00:00``).

In a job:

- SIGTERM (``scancel``, a preemption, a requeue, the time limit) stops training after the
  current batch: the job saves ``last.ckpt``, records itself interrupted and ends without
  a result. So does SIGUSR2, which SLURM sends ``signal_delay_s`` before the time limit
  (submitit's ``--signal``): the checkpoint is then saved before the limit's SIGKILL.
- A job that SLURM requeued (a preemption under ``PreemptMode=REQUEUE``, ``scontrol
  requeue``) runs again in its own dir and resumes from its own ``last.ckpt``
  (``run.job``: ``SLURM_RESTART_COUNT``).

The launcher waits on its jobs' results and on their states in ``squeue``, not
``sacct``, so a cluster without accounting works too. A requeued job is waited for. A job
that ended without a result (cancelled, timed out, killed) is reported with its state and
the command that finishes the sweep (``skip_finished=true``: it resumes from its
``last.ckpt``); the other jobs' results come back and the sweep's summary is written.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from transformers_lab.errors import ConfigError
from transformers_lab.run.callbacks.safety import note_signals
from transformers_lab.run.fit import say
from transformers_lab.run.overrides import sweep_resume
from transformers_lab.run.record import read_record

log = logging.getLogger(__name__)

# submitit's parameters common to its executors; the others are SLURM's (``slurm_<name>``)
GENERIC = {"timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes"}
GENERIC |= {"name", "stderr_to_stdout"}
OURS = {"submitit_folder", "poll_s"}  # the launcher's own
# squeue's states of a job that will not run again (a requeued job is REQUEUED, then PENDING)
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED"}
ENDED |= {"OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
RESULT_GRACE_S = 10.0  # a job's result file may show up after the job left squeue
# SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
TIME_FORMS = "minutes (240) or SLURM's form: M:S, H:M:S, D-H, D-H:M or D-H:M:S (4:00:00)"


def time_limit_minutes(value: Any) -> int:
    """A job's time limit in whole minutes (seconds round up), from minutes or SLURM's
    ``--time`` forms; anything else is refused in one line."""
    text = str(value).strip()
    minutes = 0
    if isinstance(value, bool):
        pass
    elif re.fullmatch(r"\d+(\.\d+)?", text):
        minutes = math.ceil(float(text))
    elif m := re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text):
        days, first, second, third = (int(g) if g else 0 for g in m.groups())
        if m.group(1) is not None or m.group(4) is not None:  # D-H[:M[:S]], H:M:S
            hours, mins, secs = days * 24 + first, second, third
            within = mins < 60 and secs < 60
        else:  # M:S
            hours, mins, secs = 0, first, second
            within = secs < 60
        minutes = (hours * 60 + mins + math.ceil(secs / 60)) if within else 0
    if minutes < 1:
        raise ConfigError(
            f"hydra.launcher.timeout_min={value!r} is no time limit: give {TIME_FORMS}"
        )
    return minutes


def stop_waiting(signum: int, frame: Any) -> None:
    """SIGTERM to the sweep's process while it waits: as Ctrl+C (its jobs go on)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def one_line(exc: BaseException) -> str:
    """An error's last line that says something (sbatch's ``error: ...``)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def slurm_command(name: str) -> str:
    """The path of one of SLURM's commands, or one line that says it is missing."""
    found = shutil.which(name)
    if found is None:
        raise ConfigError(
            f"launcher=slurm: no {name} on this machine's PATH (SLURM's commands are not "
            "installed here); submit from a SLURM login node, or run the sweep here with "
            "launcher=joblib"
        )
    return found


def ask(*command: str) -> str:
    """A SLURM query's output; one line with SLURM's own words when it fails."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise ConfigError(
            f"launcher=slurm: {Path(command[0]).name} failed: "
            f"{said[-1] if said else proc.returncode} (is the cluster's controller up, and "
            "SLURM_CONF right?)"
        )
    return proc.stdout


def check_partition(partition: str | None) -> None:
    """The partition must be one of the cluster's (None: the cluster's default)."""
    if partition is None:
        return
    names = ask(slurm_command("sinfo"), "-h", "-o", "%R").split()
    if str(partition) not in names:
        raise ConfigError(
            f"hydra.launcher.partition={partition}: this cluster has no such partition; it has "
            f"{', '.join(sorted(set(names))) or 'none'} (sinfo lists them)"
        )


def job_states() -> dict[str, str] | None:
    """The state of each of the user's jobs that squeue knows (array tasks one a line),
    or None when squeue cannot answer now (the controller busy): the launcher asks again."""
    try:
        out = subprocess.run(
            ["squeue", "--me", "-h", "-r", "-t", "all", "-o", "%i|%T"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return dict(line.split("|", 1) for line in out.stdout.split() if "|" in line)


def has_result(job: Any) -> bool:
    """Whether each task of a submitit job wrote its result (a job of several tasks, as
    DDP over ``tasks_per_node``, holds one sub-job a task)."""
    return all(task.paths.result_pickle.exists() for task in job._sub_jobs or [job])


class SlurmLauncher(Launcher):
    """Submit a multirun's jobs as one SLURM job array through submitit, and wait for
    their results and states (see the module's text)."""

    def __init__(self, **params: Any) -> None:
        self.params = {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in params.items()
        }
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.ended: dict[str, str] = {}  # job id -> its state, for those without a result

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    # ------------------------------------------------------------ in the job

    def __call__(self, overrides: list[str], job_num: int, singleton_state: dict) -> JobReturn:
        import submitit

        assert self.hydra_context is not None and self.config is not None
        assert self.task_function is not None
        # submitit ignores SIGTERM and requeues itself on SIGUSR2; here both stop the job
        # after a batch, saved (run.callbacks.safety.StopOnSignal)
        note_signals()
        Singleton.set_state(singleton_state)
        setup_globals()
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config.hydra.job) as job:
            job.id = submitit.JobEnvironment().job_id
            job.num = job_num
        # a job stopped by a signal raises SystemExit: no result, so the launcher reads
        # SLURM's state (requeued: wait; cancelled, timed out: say how to resume)
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )

    # ------------------------------------------------------------ in the sweep's process

    def executor(self) -> Any:
        import submitit

        params = dict(self.params)
        slurm_command("sbatch")
        check_partition(params.get("partition"))
        params["timeout_min"] = time_limit_minutes(params.get("timeout_min", 60))
        executor = submitit.AutoExecutor(folder=params["submitit_folder"], cluster="slurm")
        try:
            executor.update_parameters(
                **{
                    k if k in GENERIC else f"slurm_{k}": v
                    for k, v in params.items()
                    if k not in OURS and v is not None
                }
            )
        except (NameError, ValueError) as exc:  # a key or a value submitit does not take
            raise ConfigError(f"hydra.launcher: {str(exc).strip().splitlines()[0]}") from None
        return executor

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        import submitit

        assert self.config is not None
        executor = self.executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        nums = [initial_job_idx + i for i in range(len(job_overrides))]
        for num, overrides in zip(nums, job_overrides, strict=True):
            log.info("\t#%d : %s", num, " ".join(filter_overrides(overrides)))
        state = Singleton.get_state()
        try:  # submitit prints sbatch's refusal too: it is said once, below
            with contextlib.redirect_stderr(io.StringIO()):
                jobs = executor.map_array(
                    self, [list(o) for o in job_overrides], nums, [state] * len(nums)
                )
        except (
            submitit.core.utils.FailedJobError,
            submitit.core.utils.FailedSubmissionError,
        ) as exc:
            raise ConfigError(
                f"launcher=slurm: sbatch refused the sweep's jobs: {one_line(exc)} (check "
                "hydra.launcher's resources against the partition: sinfo, scontrol show partition)"
            ) from None
        ids = [job.job_id for job in jobs]
        say(f"submitted {len(jobs)} job(s) to SLURM: {', '.join(ids)} (squeue -u $USER)")
        self.ended = {}
        handler = signal.signal(signal.SIGTERM, stop_waiting)
        try:
            returns = self.wait(jobs, job_overrides, nums)
        except KeyboardInterrupt as exc:  # Ctrl+C or SIGTERM to this process
            self.stopped_waiting(str(exc) or "SIGINT", sweep_dir, ids)
        finally:
            signal.signal(signal.SIGTERM, handler)
        self.report(returns, ids)
        return returns

    def stopped_waiting(self, name: str, sweep_dir: Path, ids: Sequence[str]) -> None:
        """The jobs are the cluster's: they go on. Say how to stop them or finish the sweep."""
        assert self.config is not None
        resume = " ".join(sweep_resume(self.config.hydra, "the finished jobs are skipped") or ())
        say(
            f"stopped waiting ({name}): the sweep's jobs go on on the cluster "
            f"({', '.join(ids)}); scancel stops them, each saving its last.ckpt; when they "
            f"end, tlab-summarize {sweep_dir} writes the summary, or {resume}",
            file=sys.stderr,
        )
        raise SystemExit(128 + getattr(signal, name))

    def wait(
        self, jobs: Sequence[Any], job_overrides: Sequence[Sequence[str]], nums: Sequence[int]
    ) -> list[JobReturn]:
        """Each job's return, once it has a result or has ended without one."""
        poll = float(self.params.get("poll_s") or 5)
        returns: dict[int, JobReturn] = {}
        ended_at: dict[int, float] = {}
        while len(returns) < len(jobs):
            states = job_states()
            for i, job in enumerate(jobs):
                if i in returns:
                    continue
                if has_result(job):
                    returns[i] = job.results()[0]
                    continue
                if states is None:
                    continue
                state = states.get(job.job_id)
                if state is not None and state not in ENDED:
                    ended_at.pop(i, None)  # running, pending, requeued
                    continue
                first = ended_at.setdefault(i, time.monotonic())
                if time.monotonic() - first >= RESULT_GRACE_S:
                    returns[i] = self.unfinished(job_overrides[i], nums[i])
                    self.ended[job.job_id] = state or "gone from squeue"
            if len(returns) < len(jobs):
                time.sleep(poll)
        return [returns[i] for i in range(len(jobs))]

    def unfinished(self, overrides: Sequence[str], num: int) -> JobReturn:
        """The return of a job that ended without a result: NaN to the sweeper, and the
        job's dir, where its record (interrupted, or running if it was killed) is."""
        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.num = num
            out = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
            config.hydra.runtime.output_dir = str(out)
            hydra_cfg = OmegaConf.create({"hydra": config.pop("hydra")})
        return JobReturn(
            overrides=list(overrides),
            cfg=config,
            hydra_cfg=hydra_cfg,
            working_dir=str(out),
            task_name=str(hydra_cfg.hydra.job.name),
            status=JobStatus.COMPLETED,
            _return_value=math.nan,
        )

    def report(self, returns: Sequence[JobReturn], ids: Sequence[str]) -> None:
        """One line for each job that ended without a result, and how to finish the sweep."""
        assert self.config is not None
        unfinished = [(i, run) for i, run in zip(ids, returns, strict=True) if i in self.ended]
        for job_id, run in unfinished:
            out = Path(str(run.working_dir))
            record = read_record(out)
            status = "it never started" if record is None else f"its record says {record.status}"
            ended = self.ended[job_id]
            say(f"job {out.name} (SLURM {job_id}) ended {ended} without a result: {status}")
        if unfinished:
            resumes = "its stopped jobs resume from their last.ckpt"
            resume = " ".join(sweep_resume(self.config.hydra, resumes) or ())
            say(f"{len(unfinished)} job(s) of this sweep did not finish; {resume}", file=sys.stderr)
