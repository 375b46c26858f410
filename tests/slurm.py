"""A throwaway SLURM cluster for the tests: munged, slurmctld and slurmd on 127.0.0.1 with
their state in a temporary dir; one node (two CPUs, this machine's memory) and two
partitions, ``debug`` (the default) and ``urgent``, whose jobs preempt ``debug``'s
(``PreemptMode=REQUEUE``: a preempted job gets SIGTERM and is queued again). Stopped and
removed afterwards.

The binaries are Debian's (``slurm-wlm``, ``munge``) on the PATH or in ``/usr/sbin``.
slurmd starts jobs as their users, so it runs as root. Where a binary is missing, or the
tests do not run as root, ``start`` raises ``Unavailable`` with the reason (the fixture
skips with it); a cluster that is there but fails to start is an error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L

from transformers_lab.sweeps.slurm_launcher import ENDED

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
PARTITIONS = ("debug", "urgent")
KILL_WAIT_S = 10  # between a stopped job's SIGTERM and its SIGKILL
CPUS = 2  # the node's, whatever the machine has: the tests count on two jobs at once


class Unavailable(RuntimeError):
    """No SLURM cluster can be started here (the reason says why): the tests skip."""


def binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")
    if found is None:
        raise Unavailable(f"no {name}: install Debian's slurm-wlm and munge (make slurm)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    root: Path
    node: str

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self) -> dict[str, str]:
        """What a process needs to reach this cluster: SLURM's commands on the PATH and
        its config."""
        path = os.environ.get("PATH", "")
        folders = {str(Path(binary(c)).parent) for c in COMMANDS}
        return {"SLURM_CONF": str(self.conf), "PATH": os.pathsep.join([*folders, path])}

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [binary(command[0]), *command[1:]],
            env={**os.environ, **self.env()},
            capture_output=True, text=True, timeout=60, check=check,
        )  # fmt: skip

    def states(self) -> dict[str, str]:
        """Every job the controller knows, array tasks one each: id -> state."""
        out = self.run("squeue", "-h", "-r", "-t", "all", "-o", "%i|%T").stdout
        return dict(line.split("|", 1) for line in out.split())

    def restarts(self, job_id: str) -> int:
        out = self.run("scontrol", "show", "job", job_id).stdout
        return int(out.split("Restarts=", 1)[1].split()[0])

    def release(self, job_id: str, timeout: float = 60) -> None:
        """Let a requeued job start as soon as a CPU is free: SLURM holds one back for two
        minutes (its reason, BeginTime)."""

        def held() -> str | None:
            out = self.run("squeue", "-h", "-r", "-t", "all", "-j", job_id, "-o", "%T|%r").stdout
            return out.strip() or None

        wait_until(lambda: held() == "PENDING|BeginTime", timeout, f"{job_id} requeued")
        wait_until(
            lambda: self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now",
                             check=False).returncode == 0 and held() != "PENDING|BeginTime",
            timeout, f"{job_id} released",
        )  # fmt: skip

    def log(self) -> str:
        """The daemons' logs' ends, for a failure's message."""
        tails = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / name
            if path.is_file():
                tails.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(tails)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "-u", "root", check=False)
            wait_until(lambda: not set(self.states().values()) - ENDED, 30, "jobs ended")
        for daemon in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / f"{daemon}.pid"
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        for daemon in ("slurmd", "slurmctld", "munged"):  # gone before the dir goes
            pid_file = self.root / f"{daemon}.pid"
            with contextlib.suppress(Exception):
                pid = int(pid_file.read_text().split()[0])
                wait_until(lambda pid=pid: not alive(pid), 20, f"{daemon} stopped")
        shutil.rmtree(self.root, ignore_errors=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.5)


def config(root: Path, node: str) -> str:
    with open("/proc/meminfo") as f:
        total_mb = int(f.readline().split()[1]) // 1024
    lines = [
        "ClusterName=tlab-test",
        f"SlurmctldHost={node}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        *(f"{d.capitalize()}PidFile={root / d}.pid" for d in ("slurmctld", "slurmd")),
        *(f"{d.capitalize()}LogFile={root / d}.log" for d in ("slurmctld", "slurmd")),
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU_Memory",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1",
        "MpiDefault=none",
        "SlurmdParameters=config_overrides",  # the node is as configured, whatever the machine
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SwitchType=switch/none",
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        f"KillWait={KILL_WAIT_S}",
        "MessageTimeout=10",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory={max(total_mb - 2048, 1024)}"
        " State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
        "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2",
    ]
    return "\n".join(lines) + "\n"


def start(timeout: float = 30) -> Cluster:
    """A running one-node cluster whose node is idle."""
    for name in (*DAEMONS, *COMMANDS):
        binary(name)
    if os.geteuid() != 0:
        raise Unavailable("slurmd starts jobs as their users, so it runs as root: run as root")
    node = socket.gethostname().split(".")[0]
    root = Path(tempfile.mkdtemp(prefix="tlab-slurm-"))
    cluster = Cluster(root, node)
    try:
        for folder in ("state", "spool"):
            (root / folder).mkdir()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        subprocess.run(
            [binary("munged"), "--force", f"--key-file={key}", f"--socket={root / 'munge.socket'}",
             f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
             f"--seed-file={root / 'munged.seed'}"],
            check=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        cluster.conf.write_text(config(root, node))
        for daemon in ("slurmctld", "slurmd"):
            clear = ["-c"] if daemon == "slurmctld" else []
            subprocess.run(
                [binary(daemon), *clear, "-f", str(cluster.conf)],
                check=True, capture_output=True, text=True, timeout=30,
            )  # fmt: skip

        def idle() -> bool:
            out = cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.split()
            return bool(out) and all(state == "idle" for state in out)

        wait_until(idle, timeout, "the node to be idle")
    except (OSError, subprocess.SubprocessError, TimeoutError) as exc:
        said = getattr(exc, "stderr", None) or str(exc)
        logs = cluster.log()
        cluster.stop()
        said = said.strip()[-500:]
        raise RuntimeError(f"the test cluster did not start: {said}\n{logs}") from None
    return cluster


# ------------------------------------------------------------------ what the SLURM tests share

# tests/sweeps (the test modules) and tests/ (this file, whose callback a job names)
TESTS_ON_PATH = os.pathsep.join(
    [str(Path(__file__).parent / "sweeps"), str(Path(__file__).parent), *sys.path]
)


class Paced(L.Callback):
    """Mark that the job trains (``training-<seed>`` in ``$TLAB_TEST_MARKS``) and take
    ``$TLAB_TEST_PACE`` seconds a batch, so that a signal finds it training; the same
    command line runs at full speed when a resumed sweep sets the pace to 0."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        marks = Path(os.environ["TLAB_TEST_MARKS"])
        (marks / f"training-{self.seed}").touch()
        if task := os.environ.get("SLURM_ARRAY_TASK_ID"):  # a worker of an array job
            (marks / f"task-{task}").touch()
        time.sleep(float(os.environ.get("TLAB_TEST_PACE", "0")))


def paced(cluster, tmp_path: Path, pace: str) -> tuple[Path, dict[str, str]]:
    """The folder the ``Paced`` callback marks, and the environment of a sweep on the test
    cluster whose jobs take ``pace`` seconds a batch."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**cluster.env(), "TLAB_TEST_MARKS": str(marks), "TLAB_TEST_PACE": pace,
           "PYTHONPATH": TESTS_ON_PATH}  # fmt: skip
    return marks, env


def wait_for(done, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the sweep ended before {what}: {out[-2000:]}{err[-3000:]}")
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.5)


def swapped(script: str, swaps: list[tuple[str, str]]) -> str:
    """The script with each of its settings swapped for the test's: each must be there once,
    so that the test follows the doc."""
    for old, new in swaps:
        assert script.count(old) == 1, (old, script)
        script = script.replace(old, new)
    return script
