"""Workers of one study on a real PostgreSQL server, and on Optuna's journal file: four
processes share n_trials=8, one is killed with SIGKILL in the middle of a trial, and the
study still ends with exactly 8 finished trials, none run twice, after a second sweep
resumes it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.sweeps.test_optuna_sweeps import command, env_of
from transformers_lab.run.record import RESULT_FILE, read_record
from transformers_lab.sweeps import study as st
from transformers_lab.sweeps.storage import open_storage

WORKERS, TRIALS = 4, 8


def storage_of(kind: str, request, tmp_path: Path) -> str:
    if kind == "postgresql":  # the throwaway server (skips where PostgreSQL is missing)
        return request.getfixturevalue("postgres_server").url()
    return f"journal:{tmp_path / 'study.log'}"


def worker_command(sweep: Path, storage: str, name: str) -> list[str]:
    """A worker's command line: every worker, and the sweep that resumes, run the same."""
    return command(
        sweep, f"hydra.sweeper.storage={storage}", f"hydra.sweeper.study_name={name}",
        f"hydra.sweeper.n_trials={TRIALS}", "hydra.sweeper.heartbeat_interval=1",
        "trainer.max_epochs=2", "cpu_threads=1",
    )  # fmt: skip


def start_worker(
    tmp_path: Path, sweep: Path, storage: str, name: str, number: int
) -> subprocess.Popen:
    """A worker; its stderr goes to ``worker<number>.err`` (a pipe nobody reads while the
    test waits would fill and stop it)."""
    return subprocess.Popen(
        worker_command(sweep, storage, name), cwd=tmp_path, env=env_of(tmp_path),
        start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=(tmp_path / f"worker{number}.err").open("w"),
    )  # fmt: skip


@pytest.mark.slow  # 40-50 s each on 2 cores: make test-slow, which CI runs
@pytest.mark.parametrize("kind", ["postgresql", "journal"])
def test_four_workers_one_killed_end_with_exactly_n_finished_trials(kind, request, tmp_path):
    storage, name = storage_of(kind, request, tmp_path), f"w{uuid.uuid4().hex[:8]}"
    sweep = tmp_path / "sweep"
    workers = [start_worker(tmp_path, sweep, storage, name, i) for i in range(WORKERS)]
    try:
        victim = workers[0]
        study = None
        # one storage for the whole wait: each opening holds a connection of its own, and
        # a slow machine's hundreds of polls would take the server's every one
        polled = open_storage(storage)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and victim.poll() is None:  # the victim mid-trial
            try:
                study = optuna.load_study(study_name=name, storage=polled)
            except KeyError:  # not made yet
                time.sleep(0.2)
                continue
            mine = [
                t
                for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.user_attrs.get(st.OWNER, {}).get("pid") == victim.pid
            ]
            if mine and (sweep / str(mine[0].number) / RESULT_FILE).is_file():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the first worker never ran a trial")
        killed = mine[0].number
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        for number, worker in enumerate(workers[1:], start=1):
            worker.wait(timeout=300)
            err = (tmp_path / f"worker{number}.err").read_text()
            assert worker.returncode == 0, err[-3000:]
            # Optuna's warnings on every trial (heartbeats are "experimental") are not shown
            assert "ExperimentalWarning" not in err and "heartbeat" not in err.lower(), err
    finally:  # none left running, whatever failed
        for worker in workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()

    again = subprocess.run(  # a second sweep resumes the study
        worker_command(sweep, storage, name),
        cwd=tmp_path, env=env_of(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]

    study = optuna.load_study(study_name=name, storage=open_storage(storage))
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == TRIALS, [(t.number, t.state) for t in study.trials]
    assert study.trials[killed].state == TrialState.FAIL  # given up, its slot asked again
    assert len({t.number for t in finished}) == TRIALS
    for t in finished:  # each finished trial ran once, in its own dir
        assert read_record(sweep / str(t.number)).trial == t.number
