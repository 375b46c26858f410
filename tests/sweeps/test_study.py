"""The study sweeper's parts, on constructed studies: the search space read from Hydra's
sweep syntax, storages and their errors, a study reopened with another question, slots
and ranks, trials whose worker died, objectives from job records, and the Pareto front."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from transformers_lab.errors import ConfigError
from transformers_lab.run.record import JobRecord
from transformers_lab.sweeps import study as st
from transformers_lab.sweeps.optuna_sweeper import trials_csv
from transformers_lab.sweeps.report.study import front_of, pareto_front, study_section
from transformers_lab.sweeps.storage import open_storage, setup_lock

optuna.logging.set_verbosity(optuna.logging.WARNING)

LR = {"optimizer.lr": FloatDistribution(1e-4, 1e-2, log=True)}


def sqlite(tmp_path, name="study.db"):
    return open_storage(f"sqlite:///{tmp_path / name}")


# ---------------------------------------------------------------------- search space


def test_the_search_space_reads_hydras_sweep_syntax():
    space, fixed = st.search_space(
        {
            "optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
            "optimizer.weight_decay": "interval(0, 0.1)",
            "model.n_layer": "tag(int, interval(1, 4))",
            "attention": "choice(softmax, fastmax_p2)",
            "model.d_model": "32,64",
            "data.batch_size": "range(16, 65, 16)",
            "seed": "3",
        }
    )
    assert space == {
        "optimizer.lr": FloatDistribution(1e-4, 1e-2, log=True),
        "optimizer.weight_decay": FloatDistribution(0.0, 0.1),
        "model.n_layer": IntDistribution(1, 4),
        "attention": CategoricalDistribution(["softmax", "fastmax_p2"]),
        "model.d_model": CategoricalDistribution([32, 64]),
        "data.batch_size": IntDistribution(16, 64, step=16),
    }
    assert fixed == ["seed=3"]


def test_a_search_space_entry_hydra_cannot_read_is_named():
    with pytest.raises(ConfigError, match=r"'optimizer.lr=interval\(1e-4'"):
        st.search_space({"optimizer.lr": "interval(1e-4"})


@pytest.mark.parametrize(
    ("value", "override"),
    [
        (0.00123456789012345, "optimizer.lr=0.00123456789012345"),
        (64, "model.d_model=64"),
        ("fastmax_p2", "attention=fastmax_p2"),
        ("a b", "attention='a b'"),
        (True, "attention=true"),
    ],
)
def test_a_sampled_value_becomes_an_override_hydra_reads_back(value, override):
    key = override.split("=")[0]
    assert st.as_override(key, value) == override


# -------------------------------------------------------------------------- storage


def test_a_sqlite_storage_creates_its_folder(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'a' / 'b' / 'study.db'}")
    optuna.create_study(storage=storage, study_name="s")
    assert (tmp_path / "a" / "b" / "study.db").is_file()


def test_a_journal_storage_is_a_file(tmp_path):
    storage = open_storage(f"journal:{tmp_path / 'j' / 'study.log'}")
    study = optuna.create_study(storage=storage, study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    again = optuna.load_study(
        study_name="s", storage=open_storage(f"journal:{tmp_path / 'j' / 'study.log'}")
    )
    assert len(again.trials) == 2


def open_at_once(url: str, locked: bool, barrier, errors) -> None:
    barrier.wait()  # both workers go at the same moment
    try:
        if locked:
            with setup_lock(url):
                st.load_or_create(open_storage(url, 60), "s", ["maximize"], {})
        else:
            open_storage(url, 60)
    except Exception as exc:
        errors.put(str(exc))


@pytest.mark.parametrize("locked", [False, True], ids=["open_storage", "setup_lock"])
def test_workers_that_start_together_on_a_new_sqlite_file_both_open_it(tmp_path, locked):
    # unguarded, one of two workers creating a new database's tables fails on about
    # every try ("table studies already exists"); CI saw it in the two-worker sweep
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for i in range(3):
        url = f"sqlite:///{tmp_path / str(i) / 'study.db'}"
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=open_at_once, args=(url, locked, barrier, errors))]
        procs.append(ctx.Process(target=open_at_once, args=(url, locked, barrier, errors)))
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0, 0]
        assert errors.empty(), errors.get()
    if locked:
        assert len(optuna.get_all_study_summaries(open_storage(url))) == 1


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("not a url", "cannot open the study storage not a url: Could not parse"),
        ("sqlite:////proc/no/such/dir/study.db", "cannot open the study storage"),
        ("mysql://user:secret@nohost/db", "its database driver is not installed"),
    ],
)
def test_a_storage_that_cannot_be_opened_is_one_line_with_the_fix(url, said):
    with pytest.raises(ConfigError) as err:
        storage = open_storage(url)
        optuna.create_study(storage=storage, study_name="s")
    message = str(err.value)
    assert said in message and "\n" not in message
    assert "give hydra.sweeper.storage a SQLAlchemy URL" in message
    assert "secret" not in message  # the password is not printed


# ------------------------------------------------------------------ the study's question


def test_a_study_reopened_with_other_directions_or_space_is_refused(tmp_path):
    storage = sqlite(tmp_path)
    st.load_or_create(storage, "lr", ["maximize"], LR)
    st.load_or_create(storage, "lr", ["maximize"], dict(LR))  # the same question: continued
    with pytest.raises(
        ConfigError,
        match=r"exists with directions \['maximize'\]; this sweep "
        r"asks \['minimize'\]: give another hydra.sweeper.study_name",
    ):
        st.load_or_create(storage, "lr", ["minimize"], LR)
    other = {"optimizer.lr": FloatDistribution(1e-5, 1e-2, log=True)}
    with pytest.raises(ConfigError) as err:
        st.load_or_create(storage, "lr", ["maximize"], other)
    assert "exists with the search space {optimizer.lr: Float(0.0001..0.01, log)}" in str(err.value)
    assert "this sweep has {optimizer.lr: Float(1e-05..0.01, log)}" in str(err.value)


def test_a_study_reopened_with_other_fixed_settings_is_refused(tmp_path):
    """Its trials were run with experiment=mqar model.d_model=64: a sweep that gives them
    another model would rank trials that do not compare. Logging, pruning and bookkeeping
    may change; the sweep's own keys (n_trials, its dir) are not overrides of the trials."""
    storage = sqlite(tmp_path)
    settings = ["experiment=mqar", "model.d_model=64", "sweep=lr_optuna"]
    st.load_or_create(storage, "lr", ["maximize"], LR, settings=settings)
    again = ["+experiment=mqar", *reversed(settings[1:]), "pruner=median", "logger=csv"]
    again.append("skip_finished=true")
    st.load_or_create(storage, "lr", ["maximize"], LR, settings=again)
    with pytest.raises(ConfigError) as err:
        other = ["experiment=mqar", "model.d_model=32", "sweep=lr_optuna", "data.batch_size=8"]
        st.load_or_create(storage, "lr", ["maximize"], LR, settings=other)
    said = str(err.value)
    assert "study 'lr' ran its trials with model.d_model=64 where this sweep gives " in said
    assert "data.batch_size=8 model.d_model=32: its trials would not compare" in said
    assert "give another hydra.sweeper.study_name" in said


@pytest.mark.parametrize("sampler", [optuna.samplers.RandomSampler, optuna.samplers.TPESampler])
def test_a_worker_that_resumes_or_joins_a_study_does_not_replay_the_seeds_draws(tmp_path, sampler):
    """Every worker builds its sampler from the same seed (``seed: ${seed}``): the first
    worker's draws are the seed's, a later worker's (a resume, or a second worker on a
    shared storage) are new ones, not the same parameters again."""
    storage = sqlite(tmp_path)
    first = st.load_or_create(storage, "lr", ["maximize"], LR, sampler(seed=0))
    draws = [first.ask(LR).params["optimizer.lr"] for _ in range(2)]
    alone = optuna.create_study(sampler=sampler(seed=0))  # the seed's draws, for reference
    assert draws == [alone.ask(LR).params["optimizer.lr"] for _ in range(2)]
    later = st.load_or_create(storage, "lr", ["maximize"], LR, sampler(seed=0))
    again = [later.ask(LR).params["optimizer.lr"] for _ in range(2)]
    assert not set(again) & set(draws)


# ------------------------------------------------------------------- slots and losses


def test_slots_count_what_holds_one_and_ranks_follow_trial_numbers(tmp_path):
    study = st.load_or_create(sqlite(tmp_path), "s", ["maximize"], LR)
    done = study.ask(LR)
    study.tell(done, 0.5)
    pruned = study.ask(LR)
    study.tell(pruned, state=TrialState.PRUNED)
    failed = study.ask(LR)
    failed.set_user_attr(st.ERROR, "RuntimeError: NaN")
    study.tell(failed, state=TrialState.FAIL)
    lost = study.ask(LR)
    st.give_up(study, lost, "its worker is gone")
    running = study.ask(LR)
    assert st.slots_taken(study) == 4  # complete, pruned, failed by its job, running
    assert st.rank(study, running.number) == 4 and st.rank(study, lost.number) == 3
    states = [r.state for r in st.trial_rows(study)]
    assert states == ["complete", "pruned", "failed", "lost", "running"]
    rows = st.trial_rows(study)
    assert rows[2].note == "RuntimeError: NaN" and rows[3].note == "its worker is gone"


def test_a_running_trial_whose_worker_died_is_given_up_and_a_live_ones_is_kept(tmp_path):
    storage = sqlite(tmp_path)
    study = st.load_or_create(storage, "s", ["maximize"], LR)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    orphan = study.ask(LR)
    orphan.set_user_attr(st.OWNER, {"host": st.this_worker()["host"], "pid": pid, "start": "1"})
    mine = study.ask(LR)
    mine.set_user_attr(st.OWNER, st.this_worker())
    elsewhere = study.ask(LR)
    elsewhere.set_user_attr(st.OWNER, {"host": "another-host", "pid": 1, "start": None})
    lost = st.reclaim_lost(study, storage)
    assert [t.number for t in lost] == [orphan.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states[orphan.number] == TrialState.FAIL
    assert states[mine.number] == states[elsewhere.number] == TrialState.RUNNING
    assert st.slots_taken(study) == 2


def test_a_pid_given_to_a_later_process_is_not_taken_for_the_worker():
    me = st.this_worker()
    assert st.worker_alive(me) is True
    assert st.worker_alive({**me, "start": "0"}) is False  # same pid, another start time
    assert st.worker_alive({**me, "host": "elsewhere"}) is None


# ------------------------------------------------------------------- sweeper settings


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"n_trials": 0}, "hydra.sweeper.n_trials=0: give at least 1"),
        ({"directions": ["maximize", "minimize"]}, "must be lists of the same length"),
        ({"directions": ["up"]}, "['up'] is not maximize or minimize"),
        (
            {"objectives": ["val/acc", "params"], "directions": ["maximize", "minimize"],
             "pruner": "optuna.pruners.MedianPruner"},
            "Optuna prunes only single-objective studies; this one has 2 objectives "
            "(val/acc, params): give pruner=none",
        ),
    ],
)  # fmt: skip
def test_the_sweeper_refuses_settings_that_cannot_work(settings, said):
    from omegaconf import OmegaConf

    from transformers_lab.sweeps.optuna_sweeper import StudySweeper

    pruner = settings.pop("pruner", "optuna.pruners.NopPruner")
    defaults = {"objectives": ["val/acc"], "directions": ["maximize"], "n_trials": 2}
    sweeper = StudySweeper("sqlite:///x.db", "s", **(defaults | settings))
    sweeper.config = OmegaConf.create({"pruner": {"_target_": pruner}})
    with pytest.raises(ConfigError) as err:
        sweeper.check_settings()
    assert said in str(err.value)


# ------------------------------------------------------------------------- objectives


def test_objectives_come_from_the_record_or_say_what_is_missing():
    record = JobRecord(status="ok", metrics={"val/acc": 0.9}, params=1000, time_s=12.5)
    assert st.objective_values(record, ["val/acc", "params", "time_s"]) == [0.9, 1000.0, 12.5]
    said = st.objective_values(record, ["val/loss"])
    assert said == "val/loss was never logged (logged: val/acc)"
    assert st.objective_values(JobRecord(metrics={"val/acc": float("nan")}), ["val/acc"]) == (
        "val/acc is nan"
    )


# ----------------------------------------------------------------------- Pareto front


def test_the_pareto_front_of_constructed_points():
    # maximise accuracy, minimise parameters
    points = [(0.90, 100), (0.95, 200), (0.80, 50), (0.85, 150), (0.95, 300), (0.99, 400)]
    assert pareto_front(points, ["maximize", "minimize"]) == [0, 1, 2, 5]
    assert pareto_front(points, ["maximize", "maximize"]) == [5]
    assert pareto_front(points, ["minimize", "minimize"]) == [2]
    assert pareto_front([(1, 1), (1, 1)], ["maximize", "minimize"]) == [0, 1]  # ties stay


def test_a_two_objective_study_writes_its_front(tmp_path):
    study = st.load_or_create(sqlite(tmp_path), "two", ["maximize", "minimize"], LR)
    values = {0: (0.90, 100.0), 1: (0.95, 200.0), 2: (0.80, 150.0), 3: (0.99, 400.0)}
    for _number, pair in sorted(values.items()):
        study.tell(study.ask(LR), list(pair))
    st.give_up(study, study.ask(LR), "its worker is gone")
    objectives = ["val/acc", "params"]
    (tmp_path / "trials.csv").write_text(trials_csv(study, objectives))
    info = {
        "study_name": "two",
        "storage": "sqlite:///x",
        "objectives": objectives,
        "directions": ["maximize", "minimize"],
        "n_trials": 5,
    }
    (tmp_path / "study.json").write_text(json.dumps(info))
    lines = study_section(tmp_path, tmp_path)
    text = "\n".join(lines)
    assert "5 trials (4 complete, 1 lost) of n_trials=5" in text
    assert "### Pareto front (3 trials; pareto.png)" in text
    with (tmp_path / "trials.csv").open() as f:
        rows = front_of(info, list(csv.DictReader(f)))
    assert sorted(int(r["trial"]) for r in rows) == [0, 1, 3]  # trial 2 is dominated by 0
    assert sorted(t.number for t in study.best_trials) == [0, 1, 3]  # Optuna agrees
    assert (tmp_path / "pareto.png").stat().st_size > 1000


# ------------------------------------------------------------------------- the callback


def test_the_callback_reports_each_validation_and_stops_a_trial_below_the_median():
    from types import SimpleNamespace

    import torch

    from transformers_lab.sweeps.pruning import TrialPruning

    pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    study = optuna.create_study(direction="maximize", pruner=pruner)
    first = study.ask()
    first.report(0.9, 10)
    study.tell(first, 0.9)

    def validate(callback, value, step, sanity=False):
        trainer = SimpleNamespace(
            sanity_checking=sanity, global_step=step, should_stop=False, loggers=[],
            callback_metrics={"val/acc": torch.tensor(value)},
        )  # fmt: skip
        callback.on_validation_end(trainer, None)
        return trainer.should_stop

    good = TrialPruning(study.ask(), "val/acc")
    assert not validate(good, 0.1, 0, sanity=True)  # the sanity check is not reported
    assert not validate(good, 0.95, 10) and good.pruned_at is None
    bad = TrialPruning(study.ask(), "val/acc")
    assert validate(bad, 0.5, 10) and bad.pruned_at == 10
    assert study.trials[1].intermediate_values == {10: pytest.approx(0.95)}
    assert study.trials[2].intermediate_values == {10: 0.5}


def test_a_trial_number_outside_a_study_sweep_is_refused_with_the_sweeper_to_use(monkeypatch):
    from omegaconf import OmegaConf

    from transformers_lab.run import overrides as hydra_job
    from transformers_lab.sweeps import pruning

    monkeypatch.setattr(hydra_job, "hydra_config", lambda: None)  # a run of its own, not a sweep
    cfg = OmegaConf.create(
        {"trial": 3, "pruner": {"_target_": "optuna.pruners.MedianPruner"},
         "monitor": {"metric": "val/acc"}}
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"hydra/sweeper=optuna\); a run of its own"):
        pruning.pruning_callback(cfg)
    assert pruning.pruning_callback(OmegaConf.create({"trial": None, "pruner": {}})) is None


def test_a_trial_reports_the_studys_objective_not_the_checkpoint_monitor(
    tmp_path, monkeypatch, caplog
):
    """A study that minimises val/loss hears val/loss from its trials, even where the run
    keeps its best checkpoint by val/acc; a validation without it is said once."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from transformers_lab.run import overrides as hydra_job
    from transformers_lab.sweeps import pruning

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="minimize")
    study.ask()  # trial 0
    sweeper = {"storage": url, "study_name": "s", "objectives": ["val/loss"]}
    monkeypatch.setattr(hydra_job, "hydra_config", lambda: OmegaConf.create({"sweeper": sweeper}))
    cfg = OmegaConf.create(
        {"trial": 0, "pruner": {"_target_": "optuna.pruners.MedianPruner"},
         "monitor": {"metric": "val/acc"}}
    )  # fmt: skip
    callback = pruning.pruning_callback(cfg)
    assert callback.monitor == "val/loss"

    def validate(metrics, step):
        trainer = SimpleNamespace(
            sanity_checking=False, global_step=step, should_stop=False, callback_metrics=metrics
        )
        callback.on_validation_end(trainer, None)

    with caplog.at_level("WARNING"):
        validate({"val/acc": torch.tensor(0.5)}, 5)
        validate({"val/acc": torch.tensor(0.6)}, 10)
    said = [r for r in caplog.records if "not logged at validation" in r.getMessage()]
    assert len(said) == 1 and "val/acc" in said[0].getMessage()
    validate({"val/loss": torch.tensor(2.5), "val/acc": torch.tensor(0.7)}, 15)
    assert optuna.load_study(study_name="s", storage=url).trials[0].intermediate_values == {15: 2.5}


def test_a_worker_that_finds_the_study_just_made_waits_for_its_space(tmp_path, monkeypatch):
    # the creator records its space a moment after the study exists (workers started
    # together on a database server): the others wait for it and compare theirs
    import threading

    monkeypatch.setattr(st, "SPACE_WAIT_S", 5.0)
    storage = sqlite(tmp_path)
    other = {"optimizer.lr": FloatDistribution(1e-5, 1e-2, log=True)}
    for theirs, refused in ((LR, False), (other, True)):
        name = f"race-{refused}"
        study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
        later = threading.Timer(0.5, study.set_user_attr, (st.SPACE, st.space_json(theirs)))
        later.start()
        try:
            if refused:
                with pytest.raises(ConfigError, match=r"exists with the search space \{optim"):
                    st.load_or_create(storage, name, ["maximize"], LR)
            else:
                assert st.load_or_create(storage, name, ["maximize"], LR).study_name == name
        finally:
            later.join()
        assert study.user_attrs[st.SPACE] == st.space_json(theirs)  # not overwritten


def test_a_study_made_by_optuna_itself_takes_the_sweeps_space(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "SPACE_WAIT_S", 0.2)
    storage = sqlite(tmp_path)
    optuna.create_study(storage=storage, study_name="plain", direction="maximize")
    study = st.load_or_create(storage, "plain", ["maximize"], LR)
    assert study.user_attrs[st.SPACE] == st.space_json(LR)


def test_a_failed_write_of_the_space_that_is_no_race_is_raised():
    class Broken(optuna.storages.InMemoryStorage):
        def set_study_user_attr(self, study_id, key, value):
            raise RuntimeError("disk I/O error")

    with pytest.raises(RuntimeError, match="disk I/O error"):
        st.load_or_create(Broken(), "lr", ["maximize"], LR)


def test_a_file_system_without_locks_sets_up_the_study_unguarded(tmp_path, monkeypatch, caplog):
    import fcntl

    def no_flock(handle, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    url = f"journal:{tmp_path / 'study.log'}"
    with caplog.at_level("WARNING", logger="transformers_lab.sweeps.storage"), setup_lock(url):
        st.load_or_create(open_storage(url), "s", ["maximize"], LR)
    assert "no file lock here" in caplog.text and "Function not implemented" in caplog.text


def test_a_trial_its_worker_finishes_while_stale_ones_are_failed_is_not_called_lost(
    tmp_path, monkeypatch
):
    """The heartbeat check compares the running trials before and after failing the stale
    ones: one that its own worker completes in between (under load, the docs' SLURM array
    job saw it) was said lost ("its worker is gone") though it had finished."""
    storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1)
    study = optuna.create_study(storage=storage, study_name="race")
    finishing = study.ask()

    def its_worker_tells_meanwhile(_study):  # no trial is stale; one ends on its own
        study.tell(finishing, 1.0)

    monkeypatch.setattr(optuna.storages, "fail_stale_trials", its_worker_tells_meanwhile)
    assert st.reclaim_lost(study, storage) == []
    assert study.trials[0].state == TrialState.COMPLETE
