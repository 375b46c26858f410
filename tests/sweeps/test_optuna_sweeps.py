"""The study sweeper through the real entry point: a persistent study in the sweep dir,
resumed after SIGKILL, shared by two workers, pruning, several objectives, its errors,
and the dashboard reading the study."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from transformers_lab.run.record import RESULT_FILE, read_record

optuna.logging.set_verbosity(optuna.logging.WARNING)

TINY = [
    "experiment=mqar",
    "pruner=none",  # the preset's ASHA aside: these tests count trials run to their end
    "trainer.max_epochs=1",
    "data.train_examples=128",
    "data.val_examples=32",
    "trainer.enable_progress_bar=false",
    "logger=csv",
]


def command(sweep: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "transformers_lab.train", "sweep=lr_optuna", *TINY,
        f"hydra.sweep.dir={sweep}", *args,
    ]  # fmt: skip


def env_of(root: Path) -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(root)}
    env.pop("WANDB_API_KEY", None)
    return env


def run(root: Path, sweep: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(sweep, *args), cwd=root, env=env_of(root), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def study_of(sweep: Path, name: str = "lr") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{sweep / 'study.db'}")


@pytest.fixture(scope="module")
def study_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A sweep of 3 trials, logged to csv and (offline) wandb, for the module's tests that
    read a finished study: its dirs, its output, the dashboard."""
    root = tmp_path_factory.mktemp("study")
    sweep = root / "sweep"
    proc = run(root, sweep, "hydra.sweeper.n_trials=3", "logger=many")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep, proc


@pytest.mark.slow  # an end-to-end run through tlab-train (make test-slow)
def test_a_sweep_keeps_its_study_in_the_sweep_dir_and_each_trial_in_its_own_job_dir(study_sweep):
    from tests.run.test_train import read_wandb_run

    sweep, proc = study_sweep
    study = study_of(sweep)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    for trial in study.trials:
        record = read_record(sweep / str(trial.number))
        assert record.trial == trial.number and record.status == "ok"
        assert trial.value == pytest.approx(record.metrics["val/acc"])
        assert f"optimizer.lr={trial.params['optimizer.lr']!r}" in record.overrides
        assert trial.intermediate_values  # reported after each validation
        (run_file,) = (sweep / str(trial.number)).glob("wandb/offline-run-*/*.wandb")
        wandb_run = read_wandb_run(run_file)
        assert wandb_run["summary"]["trial/number"] == trial.number
        assert wandb_run["summary"]["trial/state"] == "finished"
    assert f"best: trial {study.best_trial.number}" in proc.stdout
    summary = (sweep / "summary.md").read_text()
    assert "## Study `lr`" in summary and "3 trials (3 complete) of n_trials=3" in summary


@pytest.mark.slow  # an end-to-end run through tlab-train (make test-slow)
def test_a_trial_prints_none_of_the_warnings_optuna_gives_this_sweeper(study_sweep):
    """The sweeper asks for trials outside ``Study.optimize`` and records their heartbeats
    itself, and reclaims stale trials with a function Optuna calls experimental: Optuna's
    warnings about both are expected, and said around no trial."""
    _, proc = study_sweep
    assert "trial 0: " in proc.stdout and "trial 2: " in proc.stdout
    output = proc.stdout + proc.stderr
    assert "ExperimentalWarning" not in output and "Heartbeat of storage" not in output


@pytest.mark.slow
def test_a_sweep_killed_in_its_third_trial_resumes_to_exactly_n_trials(tmp_path):
    sweep = tmp_path / "sweep"
    args = ("hydra.sweeper.n_trials=4", "trainer.max_epochs=3")
    proc = subprocess.Popen(
        command(sweep, *args), cwd=tmp_path, env=env_of(tmp_path), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    third = sweep / "2" / RESULT_FILE
    deadline = time.monotonic() + 300
    while not third.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert third.is_file(), "the third trial never started"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_record(sweep / "2").status == "running"  # killed in the middle
    before = {n: (sweep / n / RESULT_FILE).read_text() for n in ("0", "1")}

    again = run(tmp_path, sweep, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "trial 2: its worker is gone; its slot is asked again" in again.stdout
    study = study_of(sweep)
    done = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(done) == 4 and [t.number for t in done] == [0, 1, 3, 4]
    assert study.trials[2].state == TrialState.FAIL
    # no trial ran twice: the finished ones were left as they were
    assert {n: (sweep / n / RESULT_FILE).read_text() for n in ("0", "1")} == before
    assert "Launching 1 jobs locally" in again.stdout and "#0 :" not in again.stdout
    summary = (sweep / "summary.md").read_text()
    assert "5 trials (4 complete, 1 lost) of n_trials=4" in summary
    assert "its worker (pid" in summary


@pytest.mark.slow
def test_two_workers_share_one_study_without_repeating_a_trial(tmp_path):
    sweep = tmp_path / "sweep"
    args = ("hydra.sweeper.n_trials=6", "trainer.max_epochs=2")
    procs = [
        subprocess.Popen(
            command(sweep, *args),
            cwd=tmp_path,
            env=env_of(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    study = study_of(sweep)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(done) == 6 and len({t.number for t in done}) == 6
    workers = {t.user_attrs["tlab:owner"]["pid"] for t in done}
    assert workers == {p.pid for p in procs}  # each worker ran at least one
    for t in done:  # each trial in its own dir, run once
        assert read_record(sweep / str(t.number)).trial == t.number


@pytest.mark.slow
def test_the_median_pruner_stops_bad_learning_rates_early(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run(
        tmp_path, sweep, "pruner=median", "pruner.n_startup_trials=2",
        "hydra.sweeper.n_trials=8", "hydra.sweeper.sampler.n_startup_trials=4",
        "optimizer.lr=tag(log, interval(1e-7, 1e-1))",
        "trainer.max_epochs=4", "data.train_examples=256",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = study_of(sweep)
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert pruned and len(pruned) + len(complete) == 8
    full = max(t.last_step for t in complete)
    for t in pruned:
        record = read_record(sweep / str(t.number))
        assert record.status == "pruned" and record.pruned_at == t.last_step < full
        assert "test/acc" not in record.metrics  # a pruned trial is not tested
    summary = (sweep / "summary.md").read_text()
    assert f"{len(pruned)} pruned" in summary.splitlines()[2]  # the jobs' count line
    assert "| pruned |" in summary


@pytest.mark.slow
def test_a_two_objective_sweep_draws_its_pareto_front(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run(
        tmp_path, sweep, "hydra.sweeper.n_trials=3",
        "hydra.sweeper.objectives=[val/acc,params]",
        "hydra.sweeper.directions=[maximize,minimize]",
        "model.d_model=choice(16,32)",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = study_of(sweep)
    assert len(study.directions) == 2 and study.best_trials
    summary = (sweep / "summary.md").read_text()
    assert "### Pareto front" in summary and (sweep / "pareto.png").is_file()
    assert "Pareto front: trials" in proc.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["hydra.sweeper.storage=not-a-url"], "cannot open the study storage not-a-url"),
        (["pruner=sometimes"], "unknown pruner 'sometimes'; valid options are: asha, "
         "hyperband, median, none"),
        (["pruner=median", "hydra.sweeper.objectives=[val/acc,params]",
          "hydra.sweeper.directions=[maximize,minimize]"], "give pruner=none"),
    ],
)  # fmt: skip
def test_bad_study_settings_are_one_line(tmp_path, args, said):
    """The other refusals are tested on the sweeper itself (tests/sweeps/test_study.py)."""
    proc = run(tmp_path, tmp_path / "sweep", "hydra.sweeper.n_trials=1", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_a_study_name_taken_by_another_question_is_refused_in_one_line(tmp_path):
    sweep = tmp_path / "sweep"
    first = run(tmp_path, sweep, "hydra.sweeper.n_trials=1")
    assert first.returncode == 0, first.stderr[-2000:]
    for change in (
        "optimizer.lr=tag(log, interval(1e-5, 1e-2))",
        "hydra.sweeper.directions=[minimize]",
    ):
        proc = run(tmp_path, sweep, "hydra.sweeper.n_trials=2", change)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
        assert "study 'lr' in sqlite:///" in lines[0] and "give another" in lines[0]
    assert len(study_of(sweep).trials) == 1  # nothing was added


@pytest.mark.slow  # an end-to-end run through tlab-train (make test-slow)
def test_the_dashboard_reads_the_study_file(study_sweep):
    from optuna_dashboard._storage_url import get_storage

    sweep, proc = study_sweep
    # optuna-dashboard sqlite:///<sweep dir>/study.db, as the sweep prints it
    storage = get_storage(f"sqlite:///{sweep / 'study.db'}")
    (summary,) = storage.get_all_studies()
    assert summary.study_name == "lr"
    info = json.loads((sweep / "study.json").read_text())
    assert info["storage"] == f"sqlite:///{sweep / 'study.db'}"
    assert f"dashboard: optuna-dashboard sqlite:///{sweep / 'study.db'}" in proc.stdout
