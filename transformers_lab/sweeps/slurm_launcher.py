"""The SLURM launcher (``launcher=slurm``): each job of a multirun one task of a SLURM job
array, submitted through submitit, and a sweep that comes through what clusters do to
jobs: cancels, preemptions, requeues and time limits.

Before it submits, it checks what would otherwise fail as a traceback or a job that never
starts, and says each in one line: ``sbatch`` and ``squeue`` must be found and answer, the
partition must be the cluster's, the time limit must be minutes or SLURM's own form
(``4:00:00``) and a minute or more longer than ``signal_delay_s``; what sbatch itself
refuses is said in its words.

In a job:

- SIGTERM (``scancel``, a preemption, a requeue, the time limit) stops training after the
  current batch: the job saves ``last.ckpt``, records itself interrupted and ends without
  a result. So does SIGUSR2, which SLURM sends ``signal_delay_s`` before the time limit
  (submitit's ``--signal``): the checkpoint is then saved before the limit's SIGKILL.
- A job that SLURM requeued (a preemption under ``PreemptMode=REQUEUE``, ``scontrol
  requeue``) runs again in its own dir and resumes from its own ``last.ckpt``
  (``run.job``: ``SLURM_RESTART_COUNT``).

The launcher waits on its jobs' results and on their states in ``squeue``, not
``sacct``, so a cluster without accounting works too. A requeued job is waited for; a held
one is said once, with the command that releases it. A job that ended without a result
(cancelled, timed out, killed) or with an error is reported with its state and the command
that finishes the sweep (``skip_finished=true``: it resumes from its ``last.ckpt``); the
other jobs' results come back and the sweep's summary is written. Ctrl+C, SIGTERM or
SIGHUP to the sweep's own process stops its waiting only: the jobs are the cluster's.
"""

from __future__ import annotations

import contextlib
import getpass
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
HELD = {"REQUEUE_HOLD", "SPECIAL_EXIT", "SUSPENDED", "STOPPED"}  # waits on a person
# a job's result file may show up after the job left squeue (a network file system); one
# still missing then is read from the job's own record (its objective, if it finished)
RESULT_GRACE_S = 5.0
SQUEUE_SILENT_POLLS = 12  # squeue failing this many times in a row is said
# SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
TIME_FORMS = "minutes (240) or SLURM's form: M:S, H:M:S, D-H, D-H:M or D-H:M:S (4:00:00)"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # and SIGINT, Python's KeyboardInterrupt
EARLY_S = 60  # SLURM sends --signal's warning up to this long before it is due


def say(*lines: str, file: Any = None) -> None:
    """Print in the sweep's process (Lightning and torch stay unimported in it, so that
    what the launcher refuses is said in a second or two)."""
    print(*lines, sep="\n", file=file or sys.stdout, flush=True)


def time_limit_minutes(value: Any) -> int:
    """A job's time limit in whole minutes (seconds round up), from minutes or SLURM's
    ``--time`` forms; anything else is refused in one line. (In a YAML file, quote a form
    with colons: YAML reads ``4:00:00`` as the number 14400.)"""
    text = str(value).strip()
    minutes = 0
    if not isinstance(value, bool) and re.fullmatch(r"\d+(\.\d+)?", text):
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


def check_signal_delay(delay_s: Any, minutes: int) -> None:
    """SIGUSR2 must come after the job's start. SLURM looks at its jobs' times every 30 s
    or so and may send it up to 60 s before it is due, so it must be due a minute or more
    after the start: a warning sent earlier finds no job step to take it and is lost."""
    most = minutes * 60 - EARLY_S
    whole = isinstance(delay_s, int) and not isinstance(delay_s, bool)
    if not whole or not 0 < delay_s <= most:
        fix = ": lower it or raise hydra.launcher.timeout_min" if whole and delay_s > 0 else ""
        raise ConfigError(
            f"hydra.launcher.signal_delay_s={delay_s!r} must be a number of seconds above 0 "
            f"and at most the time limit ({minutes} min) less a minute, {most} s (SLURM may "
            f"send the warning up to {EARLY_S} s early){fix}"
        )


def check_options(options: Any) -> None:
    """The launcher's own options (time limit, warning signal), refused before anything
    asks the cluster: ``hydra.launcher`` of a sweep's config."""
    minutes = time_limit_minutes(options.get("timeout_min", 60))
    check_signal_delay(options.get("signal_delay_s", 120), minutes)


def stop_waiting(signum: int, frame: Any) -> None:
    """SIGTERM or SIGHUP to the sweep's process while it waits: as Ctrl+C (its jobs go on)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def last_line(exc: BaseException) -> str:
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
    """A SLURM command's output; one line with SLURM's own words when it fails."""
    name = Path(command[0]).name
    hint = "is the cluster's controller up, and SLURM_CONF right?"
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"launcher=slurm: {name} did not answer in 60 s ({hint})") from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise ConfigError(
            f"launcher=slurm: {name} failed: {said[-1] if said else proc.returncode} ({hint})"
        )
    return proc.stdout


def check_partition(partition: str | None) -> None:
    """The partition must be one of the cluster's (None: the cluster's default); hidden
    ones count."""
    if partition is None:
        return
    names = ask(slurm_command("sinfo"), "-a", "-h", "-o", "%R").split()
    if str(partition) not in names:
        raise ConfigError(
            f"hydra.launcher.partition={partition}: this cluster has no such partition; it has "
            f"{', '.join(sorted(set(names))) or 'none'} (sinfo -a lists them)"
        )


def job_states() -> dict[str, tuple[str, str]] | None:
    """The state and its reason of each of the user's jobs that squeue knows (array tasks
    one a line), or None when squeue cannot answer now (the controller busy): the launcher
    asks again."""
    try:
        out = subprocess.run(
            ["squeue", "-u", getpass.getuser(), "-h", "-r", "-t", "all", "-o", "%i|%T|%r"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    rows = (line.split("|") for line in out.stdout.splitlines() if line.count("|") == 2)
    return {job: (state, reason) for job, state, reason in rows}


def has_result(job: Any) -> bool:
    """Whether each task of a submitit job wrote its result (a job of several tasks, as
    DDP over ``tasks_per_node``, has one a task). The folder is touched first, as submitit
    does, so that a network file system shows a new file."""
    with contextlib.suppress(OSError):
        job.paths.folder.chmod(job.paths.folder.stat().st_mode)
    tasks = [job.task(k) for k in range(job.num_tasks)] if job.num_tasks > 1 else [job]
    return all(task.paths.result_pickle.exists() for task in tasks)


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

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    # ------------------------------------------------------------ in the job

    def __call__(self, overrides: list[str], job_num: int, singleton_state: dict) -> JobReturn:
        import submitit

        from transformers_lab.run.callbacks.safety import note_signals

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
        # its own options first: they need no cluster to be refused
        params["timeout_min"] = time_limit_minutes(params.get("timeout_min", 60))
        check_signal_delay(params.get("signal_delay_s", 120), params["timeout_min"])
        slurm_command("sbatch")
        ask(slurm_command("squeue"), "-u", getpass.getuser(), "-h", "-o", "%i")  # answers
        check_partition(params.get("partition"))
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
        refused = (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError)
        try:  # submitit prints sbatch's refusal too: it is said once, below
            with contextlib.redirect_stderr(io.StringIO()):
                jobs = executor.map_array(
                    self, [list(o) for o in job_overrides], nums, [state] * len(nums)
                )
        except refused as exc:
            raise ConfigError(
                f"launcher=slurm: sbatch refused the sweep's jobs: {last_line(exc)} (check "
                "hydra.launcher's resources against the partition: sinfo, scontrol show partition)"
            ) from None
        ids = [job.job_id for job in jobs]
        say(f"submitted {len(jobs)} job(s) to SLURM: {', '.join(ids)} (squeue -u $USER)")
        handlers = {s: signal.signal(s, stop_waiting) for s in STOP_SIGNALS}
        try:
            returns, unfinished = self.wait(jobs, job_overrides, nums)
        except KeyboardInterrupt as exc:  # Ctrl+C, SIGTERM or SIGHUP to this process
            self.stopped_waiting(str(exc) or "SIGINT", sweep_dir, ids)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        self.report(returns, unfinished, ids)
        return returns

    def wait(
        self, jobs: Sequence[Any], job_overrides: Sequence[Sequence[str]], nums: Sequence[int]
    ) -> tuple[list[JobReturn], dict[int, str]]:
        """Each job's return, once it has a result or has ended without one; and for those
        without (by index), what happened to them."""
        poll = float(self.params.get("poll_s") or 5)
        returns: dict[int, JobReturn] = {}
        unfinished: dict[int, str] = {}
        ended_at: dict[int, float] = {}
        held: set[int] = set()
        silent = 0
        while len(returns) < len(jobs):
            states = job_states()
            silent = 0 if states is not None else silent + 1
            if silent and silent % SQUEUE_SILENT_POLLS == 0:
                log.warning("squeue has not answered for %d polls: still waiting", silent)
            for i, job in enumerate(jobs):
                if i in returns:
                    continue
                if has_result(job):
                    returns[i], error = self.result(job, job_overrides[i], nums[i])
                    if error is not None:
                        unfinished[i] = error
                    continue
                if states is None:
                    continue
                state, reason = states.get(job.job_id, (None, ""))
                if (state in HELD or reason.startswith("JobHeld")) and i not in held:
                    held.add(i)
                    say(f"job {nums[i]} (SLURM {job.job_id}) is held ({state}, {reason}): "
                        f"scontrol release {job.job_id} lets it run")  # fmt: skip
                if state is not None and state not in ENDED:
                    ended_at.pop(i, None)  # running, pending, requeued, held
                    continue
                first = ended_at.setdefault(i, time.monotonic())
                if time.monotonic() - first >= RESULT_GRACE_S:
                    returns[i] = self.without_result(job, job_overrides[i], nums[i])
                    if (record := read_record(returns[i].working_dir)) is None or (
                        record.status != "ok"
                    ):
                        unfinished[i] = f"ended {state or '(squeue no longer lists it)'}"
            if len(returns) < len(jobs):
                time.sleep(poll)
        return [returns[i] for i in range(len(jobs))], unfinished

    def result(self, job: Any, overrides: Sequence[str], num: int) -> tuple[JobReturn, str | None]:
        """The job's own return; a job that raised (an error outside training, which the job
        records itself) is a NaN with its error's last line."""
        try:
            return job.results()[0], None
        except Exception as exc:  # the sweep goes on: the others' results are waited for
            where = job.paths.stderr
            return self.without_result(job, overrides, num), f"raised {last_line(exc)} ({where})"

    def without_result(self, job: Any, overrides: Sequence[str], num: int) -> JobReturn:
        """The return of a job that gave none: its record's objective if it finished (its
        result file lost), else NaN to the sweeper; and the job's dir, where its record is."""
        assert self.hydra_context is not None and self.config is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.num = num
            config.hydra.job.id = job.job_id
            out = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
            config.hydra.runtime.output_dir = str(out)
            hydra_cfg = OmegaConf.create({"hydra": config.pop("hydra")})
        record = read_record(out)
        finished = record is not None and record.status == "ok" and record.objective is not None
        return JobReturn(
            overrides=list(overrides),
            cfg=config,
            hydra_cfg=hydra_cfg,
            working_dir=str(out),
            task_name=str(hydra_cfg.hydra.job.name),
            status=JobStatus.COMPLETED,
            _return_value=record.objective if finished else math.nan,
        )

    def report(
        self, returns: Sequence[JobReturn], unfinished: dict[int, str], ids: Sequence[str]
    ) -> None:
        """One line for each job that did not finish, and how to finish the sweep."""
        assert self.config is not None
        for i, what in sorted(unfinished.items()):
            out = Path(str(returns[i].working_dir))
            record = read_record(out)
            status = "it never started" if record is None else f"its record says {record.status}"
            say(f"job {out.name} (SLURM {ids[i]}) {what} without a result: {status}")
        if unfinished:
            resumes = "its stopped jobs resume from their last.ckpt"
            resume = " ".join(sweep_resume(self.config.hydra, resumes) or ())
            say(f"{len(unfinished)} job(s) of this sweep did not finish; {resume}", file=sys.stderr)

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
