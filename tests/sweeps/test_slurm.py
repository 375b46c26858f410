"""Sweeps through ``launcher=slurm`` on a real one-node SLURM cluster (tests/slurm.py): a job
cancelled, one preempted and requeued, one out of time, and the sweep that comes through
all three with every job finished once; and the bad input refused before submitting."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transformers_lab.errors import ConfigError
from transformers_lab.run.curves import history
from transformers_lab.run.record import RESULT_FILE
from transformers_lab.sweeps import study as st
from transformers_lab.sweeps.slurm_launcher import ENDED, time_limit_minutes

import postgres
from slurm import paced, swapped, wait_for

HERE = Path(__file__).parent  # this file and tests/ (slurm.py: its callback by module name)
SWEEPS_DOC = HERE.parents[1] / "docs" / "sweeps.md"
TESTS_ON_PATH = os.pathsep.join([str(HERE), str(HERE.parent), *sys.path])

TINY = [
    "experiment=mqar",
    "data.train_examples=128",
    "data.val_examples=32",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "logger=csv",
]
# one CPU and 1 GB a job: the two-core node runs two at once
ON_THE_TEST_CLUSTER = [
    "launcher=slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.gpus_per_node=null",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.poll_s=1",
]
PACED = ["+callbacks.pace._target_=slurm.Paced", "+callbacks.pace.seed=${seed}"]


def tlab_train(*args: str, cwd: Path, env: dict[str, str], wait: bool = True):
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(cwd), **env}
    env.pop("WANDB_API_KEY", None)
    command = [sys.executable, "-m", "transformers_lab.train", *args]
    if not wait:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def sweep_dir_of(root: Path) -> Path:
    (found,) = list((root / "logs" / "train" / "multiruns").iterdir())
    return found


def record(job_dir: Path) -> dict:
    return json.loads((job_dir / RESULT_FILE).read_text())


def job_log(job_dir: Path) -> str:
    """What the sweep's jobs printed on the cluster (submitit's logs, every submission's);
    a line about one job names its dir."""
    submitit = job_dir.parent / ".submitit"
    return "\n".join(p.read_text() for p in sorted(submitit.glob("*/*_log.*")))


# ------------------------------------------------------------------ bad input, one line each


@pytest.mark.parametrize(
    ("given", "minutes"),
    [(240, 240), ("90", 90), ("30:30", 31), ("4:00:00", 240), ("1-00", 1440), ("1-2:30", 1590),
     ("2-00:00:30", 2881), (0.5, 1), ("90:00", 90)],
)  # fmt: skip
def test_a_time_limit_is_minutes_or_slurm_s_own_forms(given, minutes):
    assert time_limit_minutes(given) == minutes


@pytest.mark.parametrize("given", ["1h", "4:00:00:00", "1:75:00", "0", "-5", "", "1-", True])
def test_a_time_limit_in_another_form_is_refused_in_one_line(given):
    with pytest.raises(ConfigError) as caught:
        time_limit_minutes(given)
    said = str(caught.value)
    assert said.startswith(f"hydra.launcher.timeout_min={given!r} is no time limit: give minutes")
    assert "4:00:00" in said and "\n" not in said


def test_launcher_slurm_without_sbatch_says_so_and_names_the_fix(tmp_path):
    """No SLURM commands on the PATH (a laptop): one line that names launcher=joblib."""
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = tlab_train(
        "-m", "launcher=slurm", "seed=0,1", *TINY, cwd=tmp_path, env={"PATH": str(empty)}
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: launcher=slurm: no sbatch on this machine's PATH")
    assert "launcher=joblib" in line


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("hydra.launcher.partition=gpu", "error: hydra.launcher.partition=gpu: this cluster has "
         "no such partition; it has debug, urgent"),
        ("hydra.launcher.timeout_min=4h", "error: hydra.launcher.timeout_min='4h' is no time "
         "limit: give minutes"),
        ("hydra.launcher.signal_delay_s=0", "error: hydra.launcher.signal_delay_s=0 must be a "
         "number of seconds above 0 and at most the time limit (240 min) less a minute, "
         "14340 s"),
        # SLURM may warn up to 60 s early: a warning due 30 s after the start is refused
        ("hydra.launcher.timeout_min=1 hydra.launcher.signal_delay_s=30", "error: "
         "hydra.launcher.signal_delay_s=30 must be a number of seconds above 0 and at most "
         "the time limit (1 min) less a minute, 0 s (SLURM may send the warning up to 60 s "
         "early): lower it or raise hydra.launcher.timeout_min"),
        ("hydra.launcher.gpus_per_node=1", "error: launcher=slurm: sbatch refused the sweep's "
         "jobs: sbatch: error: Invalid generic resource (gres) specification (check "),
        ("+hydra.launcher.nodes_list=x", "error: hydra.launcher: Unknown argument 'nodes_list' "
         "for executor 'slurm'"),
    ],
)  # fmt: skip
def test_what_the_cluster_cannot_take_is_refused_in_one_line(
    slurm_cluster, override, said, tmp_path
):
    proc = tlab_train(
        "-m", *ON_THE_TEST_CLUSTER, *override.split(), "seed=0,1", *TINY, cwd=tmp_path,
        env=slurm_cluster.env(),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(said), line
    assert "submitted" not in proc.stdout  # nothing was queued


def test_without_slurm_the_cluster_is_unavailable_and_says_why(monkeypatch):
    """A newcomer's machine: the SLURM tests skip with the reason and the fix."""
    import slurm

    monkeypatch.setattr(slurm.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(slurm.Unavailable, match=r"^no munged: install Debian's slurm-wlm"):
        slurm.start()
    monkeypatch.undo()
    monkeypatch.setattr(slurm, "binary", lambda name: f"/usr/bin/{name}")  # installed,
    monkeypatch.setattr(slurm.os, "geteuid", lambda: 1000)  # but not root
    with pytest.raises(slurm.Unavailable, match="slurmd starts jobs as their users"):
        slurm.start()


# ------------------------------------------------------------------ a sweep on the cluster


def assert_resumed_once(job_dir: Path) -> None:
    """The job finished, its curve joined across one resume from its own last.ckpt."""
    assert record(job_dir)["status"] == "ok"
    assert (job_dir / "csv.1" / "metrics.csv").is_file()
    rows, resumes = history(job_dir)
    assert len(resumes) == 1 and 0 < resumes[0] < 24, resumes
    steps = [int(r["step"]) for r in rows if "train/loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 23, steps  # 6 epochs of 4 batches


@pytest.mark.slow
def test_a_sweep_comes_through_a_cancel_and_a_preemption_with_every_job_finished_once(
    slurm_cluster, tmp_path
):
    """4 jobs, two at a time on the two-core node. While jobs 0 and 1 train, a job of the
    ``urgent`` partition preempts one (SIGTERM: it saves last.ckpt; SLURM queues it again,
    and it resumes from that checkpoint) and the other is cancelled (``scancel``: it saves
    and records itself interrupted). The launcher waits for the requeued job, reports the
    cancelled one with the command that finishes the sweep, and writes the summary. That
    command resumes the cancelled job alone: every job finished once."""
    marks, env = paced(slurm_cluster, tmp_path, "0.5")
    sweep_args = ["-m", *ON_THE_TEST_CLUSTER, "seed=0,1,2,3", *TINY, "trainer.max_epochs=6"]
    proc = tlab_train(*sweep_args, *PACED, cwd=tmp_path, env=env, wait=False)
    try:
        training = [marks / f"training-{seed}" for seed in (0, 1)]
        wait_for(lambda: all(m.exists() for m in training), 180, "jobs 0 and 1 to train", proc)
        running = {j for j, s in slurm_cluster.states().items() if s == "RUNNING"}
        assert len(running) == 2, slurm_cluster.states()
        slurm_cluster.run(
            "sbatch", "-p", "urgent", "-c", "1", "--mem=100", "-o", "/dev/null",
            "--wrap", "sleep 1",
        )  # fmt: skip
        requeued = {"PENDING", "REQUEUED"}
        wait_for(
            lambda: any(slurm_cluster.states().get(j) in requeued for j in running), 60,
            "a preemption", proc,
        )  # fmt: skip
        states = slurm_cluster.states()
        (preempted,) = (j for j in running if states[j] in requeued)
        (cancelled,) = running - {preempted}
        slurm_cluster.run("scancel", cancelled)
        slurm_cluster.release(preempted)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    sweep = sweep_dir_of(tmp_path)
    jobs = {int(j.split("_")[1]): j for j in (preempted, cancelled)}
    cancelled_dir = sweep / str(next(k for k, j in jobs.items() if j == cancelled))
    preempted_dir = sweep / str(next(k for k, j in jobs.items() if j == preempted))
    # the preempted job: requeued once, resumed from its own checkpoint, finished
    assert slurm_cluster.restarts(preempted) == 1
    assert f"resuming from {preempted_dir / 'checkpoints' / 'last.ckpt'} (SLURM requeued" in (
        job_log(preempted_dir)
    )
    assert_resumed_once(preempted_dir)
    # the cancelled one: saved, recorded, reported with the command that finishes the sweep
    stopped = record(cancelled_dir)
    assert stopped["status"] == "interrupted" and "SIGTERM" in stopped["error"]
    assert (cancelled_dir / "checkpoints" / "last.ckpt").is_file()
    said = out + err
    assert (
        f"job {cancelled_dir.name} (SLURM {cancelled}) ended CANCELLED without a result: its "
        "record says interrupted"
    ) in said, said[-3000:]
    assert said.count("without a result") == 1  # the preempted job is no loss
    assert f"hydra.sweep.dir={sweep} skip_finished=true" in said
    finished = {k: (sweep / str(k) / RESULT_FILE).stat().st_mtime_ns for k in range(4)}
    del finished[int(cancelled_dir.name)]
    assert all(record(sweep / str(k))["status"] == "ok" for k in finished)

    resumed = tlab_train(
        *sweep_args, *PACED, f"hydra.sweep.dir={sweep}", "skip_finished=true", cwd=tmp_path,
        env={**env, "TLAB_TEST_PACE": "0"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed_once(cancelled_dir)
    for k, mtime in finished.items():  # skipped: their records untouched
        assert (sweep / str(k) / RESULT_FILE).stat().st_mtime_ns == mtime
    summary = (sweep / "summary.md").read_text()
    assert "| 4/4 |" in summary, summary


@pytest.mark.slow
def test_a_job_out_of_time_saves_and_a_second_submission_resumes_it(slurm_cluster, tmp_path):
    """A two-minute limit with SIGUSR2 20 s before it (SLURM looks at its jobs' times every
    30 s or so and may send it up to 60 s early: it comes 40 to 100 s after the start), and
    a job of 24 batches at 5 s each: at the warning, well after its start, it saves
    last.ckpt and records itself interrupted, before the limit. The launcher reports it;
    the same sweep submitted again with a longer limit and skip_finished=true resumes it
    to the end."""
    marks, env = paced(slurm_cluster, tmp_path, "5")
    sweep_args = ["-m", *ON_THE_TEST_CLUSTER, "seed=0", *TINY, "trainer.max_epochs=6", *PACED]
    limited = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=20"]
    first = tlab_train(*sweep_args, *limited, cwd=tmp_path, env=env)
    said = first.stdout + first.stderr
    sweep = sweep_dir_of(tmp_path)
    job = sweep / "0"
    stopped = record(job)
    assert stopped["status"] == "interrupted", said[-3000:]
    assert "SIGUSR2" in stopped["error"]  # the warning, not the limit's SIGTERM
    assert (job / "checkpoints" / "last.ckpt").is_file()
    # it ended itself at the warning (exit 140), before the limit: SLURM says FAILED
    assert re.search(r"job 0 \(SLURM \d+\) ended FAILED without a result: its record says "
                     "interrupted", said), said[-3000:]  # fmt: skip
    assert first.returncode == 1  # none of its jobs finished

    resumed = tlab_train(
        *sweep_args, "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}",
        "skip_finished=true", cwd=tmp_path, env={**env, "TLAB_TEST_PACE": "0"},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {job / 'checkpoints' / 'last.ckpt'} (skip_finished=true" in job_log(job)
    assert_resumed_once(job)


@pytest.mark.slow
def test_a_signal_to_the_sweep_s_process_leaves_its_jobs_to_the_cluster(slurm_cluster, tmp_path):
    """SIGTERM to the process that waits (its terminal closed, ``timeout``): it says that
    the jobs go on and how to stop them or finish the sweep, and exits 143; the jobs
    finish on the cluster and tlab-summarize writes their summary."""
    marks, env = paced(slurm_cluster, tmp_path, "0.5")
    args = ["-m", *ON_THE_TEST_CLUSTER, "seed=0,1", *TINY, "trainer.max_epochs=2", *PACED]
    proc = tlab_train(*args, cwd=tmp_path, env=env, wait=False)
    try:
        wait_for(lambda: any(marks.iterdir()), 180, "a job to train", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    sweep = sweep_dir_of(tmp_path)
    said = err.strip().splitlines()[-1]
    assert said.startswith("stopped waiting (SIGTERM): the sweep's jobs go on on the cluster"), said
    assert f"tlab-summarize {sweep} writes the summary" in said
    assert f"hydra.sweep.dir={sweep} skip_finished=true" in said
    wait_for(lambda: all((sweep / str(k) / RESULT_FILE).is_file() for k in (0, 1))
             and all(record(sweep / str(k))["status"] == "ok" for k in (0, 1)),
             120, "the jobs to finish on the cluster")  # fmt: skip
    summarized = subprocess.run(
        [sys.executable, "-m", "transformers_lab.sweeps.report.cli", str(sweep)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert summarized.returncode == 0, summarized.stderr[-2000:]
    assert "| 2/2 |" in (sweep / "summary.md").read_text()


# ------------------------------------------------------------------ an array job on one study


def array_job_script() -> str:
    """docs/sweeps.md's SLURM array of workers on one PostgreSQL study, as written."""
    blocks = re.findall(
        r"```bash\n(#!/bin/bash\n#SBATCH --array.*?)```", SWEEPS_DOC.read_text(), re.S
    )
    (script,) = blocks
    return script


@pytest.mark.slow
def test_the_docs_array_job_shares_one_postgresql_study_and_survives_a_cancelled_worker(
    slurm_cluster, postgres_server, tmp_path
):
    """The docs' script, with this cluster's sizes and the test server: ``sbatch`` of 4
    workers on one study of 8 trials; the first worker seen training is cancelled. It
    gives its trial up as it stops (its record says interrupted, its slot is asked again),
    the other workers share the rest, and the study ends with 8 finished trials, each run
    once by one worker, and none beyond them."""
    import optuna

    sweep = tmp_path / "study"
    marks, paced_env = paced(slurm_cluster, tmp_path, "0.5")
    budget = [*TINY, "trainer.max_epochs=2", "pruner=none", *PACED]
    script = swapped(
        array_job_script(),
        [
            ("--array=0-7", "--array=0-3"),
            (" --gres=gpu:1", ""),
            ("trainer=gpu", "trainer=cpu"),
            ("@db.cluster/", f"@{postgres_server.host}:{postgres_server.port}/"),
            ("hydra.sweeper.n_trials=64", "hydra.sweeper.n_trials=8"),
            ("hydra.sweep.dir=/shared/sweeps/mqar-lr",
             f"hydra.sweep.dir={sweep} {' '.join(budget)}"),
        ],
    )  # fmt: skip
    (tmp_path / "study.sh").write_text(script.replace("${seed}", "\\${seed}"))
    venv_bin = str(Path(sys.executable).parent)  # tlab-train
    env = {**os.environ, **paced_env, "WANDB_MODE": "offline", "TLAB_ROOT": str(tmp_path),
           "PGPASSWORD": postgres.PASSWORD}  # fmt: skip
    env["PATH"] = os.pathsep.join([venv_bin, env["PATH"]])
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-c", "1", "--mem=1G", "-o", str(tmp_path / "worker-%a.out"),
         str(tmp_path / "study.sh")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    array = submitted.stdout.strip().split(";")[0]
    workers = [f"{array}_{k}" for k in range(4)]

    def first_training() -> str | None:
        found = sorted(marks.glob("task-*"), key=lambda p: p.stat().st_mtime)
        return found[0].name.split("-")[1] if found else None

    wait_for(lambda: first_training() is not None, 180, "a worker to train")
    cancelled = f"{array}_{first_training()}"
    slurm_cluster.run("scancel", cancelled)
    wait_for(
        lambda: all(slurm_cluster.states().get(w) in ENDED for w in workers), 300,
        "every worker to end",
    )  # fmt: skip
    states = slurm_cluster.states()
    logs = {w: (tmp_path / f"worker-{w.split('_')[1]}.out").read_text() for w in workers}
    assert states[cancelled] == "CANCELLED"
    assert all(states[w] == "COMPLETED" for w in workers if w != cancelled), (states, logs)

    study = optuna.load_study(study_name="mqar-lr", storage=postgres_server.url())
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    given_up = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(finished) == 8 and len(trials) == 9, [(t.number, t.state) for t in trials]
    (lost,) = given_up
    assert st.ERROR not in lost.user_attrs  # given up, not failed: its slot was asked again
    assert record(sweep / str(lost.number))["status"] == "interrupted"
    for trial in finished:  # each run once, to its end, by one worker
        job = sweep / str(trial.number)
        assert record(job)["status"] == "ok"
        assert not (job / "csv.1").exists()
    said = "".join(logs.values())
    for trial in finished:
        assert said.count(f"trial {trial.number}: ") == 1, said[-3000:]


# ------------------------------------------------------------------ DDP inside a SLURM job

TRAINING_DOC = HERE.parents[1] / "docs" / "training.md"


def ddp_job_script() -> str:
    """docs/training.md's sbatch script of a DDP job on several nodes, as written."""
    blocks = re.findall(
        r"```bash\n(#!/bin/bash\n#SBATCH --nodes.*?)```", TRAINING_DOC.read_text(), re.S
    )
    (script,) = blocks
    return script


@pytest.mark.slow
def test_the_docs_ddp_job_trains_as_one_process_and_resumes_after_a_requeue(
    slurm_cluster, tmp_path
):
    """The docs' sbatch script on this cluster's one node: 2 srun tasks (--ntasks-per-node=2)
    become one DDP job of 2 CPU processes over gloo, Lightning reading SLURM's environment.
    While it trains, ``scontrol requeue``: both tasks stop with last.ckpt, SLURM runs the
    job again, and it resumes from its own checkpoint in its own run dir. Its loss curve
    over the 42 steps, across the resume, is one process's on the combined batch."""
    from tests.end_to_end.test_distributed import RUN, train_one_process_on_the_combined_batch

    marks, env = paced(slurm_cluster, tmp_path, "0.3")
    script = swapped(
        ddp_job_script(),
        [
            ("--nodes=4", "--nodes=1"),
            ("--ntasks-per-node=8", "--ntasks-per-node=2"),
            ("#SBATCH --gpus-per-node=8\n", ""),
            ("--cpus-per-task=12", "--cpus-per-task=1 --mem=2G"),
            ("--time=48:00:00", "--time=30"),
            ("TLAB_CORPUS_DIR=/shared/corpora srun", "srun"),
            ("trainer=ddp trainer.devices=8 trainer.num_nodes=4",
             "trainer=ddp_cpu trainer.devices=2 trainer.num_nodes=1"),
            ("paths.log_dir=/shared/logs", f"paths.log_dir={tmp_path / 'logs'}"),
            ("size=340m attention=gated_deltanet 'data.sources=[/shared/corpus]'",
             " ".join([*RUN, *PACED]).replace("${seed}", "0")),
        ],
    )  # fmt: skip
    (tmp_path / "ddp.sh").write_text(script)
    venv_bin = str(Path(sys.executable).parent)  # tlab-train
    env = {**os.environ, **env, "WANDB_MODE": "offline"}
    env["PATH"] = os.pathsep.join([venv_bin, env["PATH"]])
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(tmp_path / "ddp.sh")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    output = tmp_path / f"slurm-{job}.out"
    wait_for(lambda: (marks / "training-0").exists(), 180, "the job to train")
    time.sleep(3)  # some steps in
    slurm_cluster.run("scontrol", "requeue", job)
    slurm_cluster.release(job)
    wait_for(lambda: slurm_cluster.states().get(job) in ENDED, 300, "the job to end")
    said = output.read_text() if output.is_file() else ""
    assert slurm_cluster.states()[job] == "COMPLETED", said[-3000:]
    assert slurm_cluster.restarts(job) == 1
    run_dir = tmp_path / "logs" / "train" / "runs" / f"slurm-{job}.0"
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} (SLURM requeued" in said
    assert said.count("final metrics:") == 1  # the first task alone prints
    assert (run_dir / ".hydra").is_dir() and (run_dir / ".hydra.rank1").is_dir()
    assert record(run_dir)["status"] == "ok"

    rows, resumes = history(run_dir)
    assert len(resumes) == 1 and 0 < resumes[0] < 42, resumes
    one_rows, _ = history(train_one_process_on_the_combined_batch(tmp_path / "one"))
    for key, logged in (("train/loss", 42), ("val/loss", 2)):  # every step, every epoch
        two = [(r["step"], r[key]) for r in rows if key in r]
        one = [(r["step"], r[key]) for r in one_rows if key in r]
        assert [s for s, _ in two] == [s for s, _ in one] and len(one) == logged, key
        assert [v for _, v in two] == pytest.approx([v for _, v in one], abs=1e-5), key
