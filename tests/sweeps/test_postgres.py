"""Studies on a real PostgreSQL server (the throwaway one of tests/postgres.py): a plain
``postgresql://`` URL works as written, a server that cannot be used is one line, and the
dashboard serves the server's studies."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from transformers_lab.errors import ConfigError
from transformers_lab.sweeps import study as st
from transformers_lab.sweeps.storage import open_storage, with_driver

from postgres import DATABASE, PASSWORD, USER, free_port


def test_a_plain_postgresql_url_holds_a_study(postgres_server):
    url = postgres_server.url()
    assert url.startswith("postgresql://")  # no driver named: the installed one is used
    study = optuna.create_study(storage=open_storage(url), study_name="plain")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    again = optuna.load_study(storage=open_storage(url), study_name="plain")
    assert len(again.trials) == 2 and again.best_value == study.best_value


@pytest.mark.skipif(
    importlib.util.find_spec("psycopg2") is not None, reason="psycopg2 serves postgresql://"
)
def test_the_url_names_the_installed_driver():
    assert with_driver("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert with_driver("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert with_driver("postgresql+psycopg2://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert with_driver("sqlite:///x.db") == "sqlite:///x.db"


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("down", "no PostgreSQL server answers at 127.0.0.1:{port} (connection refused)"),
        ("password", "the server at 127.0.0.1:{port} refused user 'tlab': wrong or missing"),
        ("database", "the server at 127.0.0.1:{port} has no database 'nope'; create it"),
        ("user", "the server at 127.0.0.1:{port} refused user 'nobody'"),
        ("host", "no host 'nohost.invalid' is known here"),
    ],
)
def test_a_server_that_cannot_be_used_is_one_line(postgres_server, case, said):
    port = free_port() if case == "down" else postgres_server.port
    url = {
        "down": f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{port}/{DATABASE}",
        "password": postgres_server.url(password="wrong"),
        "database": postgres_server.url(database="nope"),
        "user": postgres_server.url(user="nobody"),
        "host": f"postgresql://{USER}:{PASSWORD}@nohost.invalid/{DATABASE}",
    }[case]
    with pytest.raises(ConfigError) as err:
        open_storage(url)
    message = str(err.value)
    assert said.format(port=port) in message and "\n" not in message, message
    assert PASSWORD not in message and ":wrong@" not in message  # passwords hidden


def test_the_dashboard_serves_a_study_of_the_server(postgres_server):
    """optuna-dashboard on the server's study, bound to 127.0.0.1, answers /api/studies."""
    url = postgres_server.url()
    optuna.create_study(storage=open_storage(url), study_name="seen").optimize(
        lambda trial: trial.suggest_float("x", 0, 1), n_trials=1
    )
    port = free_port()
    dashboard = Path(sys.executable).parent / "optuna-dashboard"
    server = subprocess.Popen(
        [str(dashboard), with_driver(url), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline, answer = time.monotonic() + 60, None
        while answer is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies") as reply:
                    answer = json.load(reply)
            except OSError:  # not listening yet
                time.sleep(0.2)
        assert answer is not None, server.stderr.read() if server.poll() is not None else "late"
        studies = answer["study_summaries"]  # the dashboard's own name for its list
        assert "seen" in [study["study_name"] for study in studies]
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # this test asks without optimize
def test_a_worker_on_another_host_is_known_dead_by_its_heartbeat_alone(postgres_server):
    """Its pid says nothing here: the trial it left running is given up once its heartbeat
    is older than the grace period (4 intervals), and its slot is asked again; a trial of
    another host whose heartbeat goes on is kept."""
    storage = open_storage(postgres_server.url(), heartbeat_interval=1)
    study = optuna.create_study(storage=storage, study_name="far")
    dead, alive = study.ask(), study.ask()
    for trial in (dead, alive):
        storage.set_trial_user_attr(trial._trial_id, st.OWNER, {"host": "far", "pid": 1})
        storage.record_heartbeat(trial._trial_id)
    assert st.reclaim_lost(study, storage) == []  # both heartbeats are fresh
    deadline = time.monotonic() + 4 * 1 + 2
    while time.monotonic() < deadline:  # only the live one keeps beating
        storage.record_heartbeat(alive._trial_id)
        time.sleep(0.5)
    lost = st.reclaim_lost(study, storage)
    assert [t.number for t in lost] == [dead.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {dead.number: TrialState.FAIL, alive.number: TrialState.RUNNING}
    rows = {row.number: row for row in st.trial_rows(study)}
    assert rows[dead.number].state == "lost" and "no heartbeat" in rows[dead.number].note
