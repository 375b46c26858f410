"""The pruning benchmark runs and writes a well-formed report (its figures come from the
full run in the README, not from here)."""

from __future__ import annotations

import csv

import pytest

from transformers_lab.bench.study import COLUMNS, compare, main


@pytest.mark.slow
def test_the_pruning_bench_runs_each_pruner_and_reports_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    tiny = ["trainer.max_epochs=2", "data.train_examples=128", "data.val_examples=32"]
    assert main(["--trials", "2", "--out", str(tmp_path / "out"), *tiny]) == 0
    with open(tmp_path / "out" / "study_bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["pruner"] for r in rows] == ["none", "median"] and list(rows[0]) == COLUMNS
    for row in rows:
        assert float(row["wall_s"]) > 0 and 0 <= float(row["best"]) <= 1
        assert int(row["complete"]) + int(row["pruned"]) == 2 and int(row["steps"]) > 0
    report = (tmp_path / "out" / "study_bench.md").read_text()
    assert "pruner=median against pruner=none:" in report
    assert "pruner=median against pruner=none:" in capsys.readouterr().out


def test_the_comparison_is_against_the_first_pruner():
    rows = [
        {"pruner": "none", "wall_s": 100.0, "best": 0.90, "steps": 1000},
        {"pruner": "median", "wall_s": 60.0, "best": 0.91, "steps": 500},
        {"pruner": "none", "wall_s": 120.0, "best": 0.92, "steps": 1000},
        {"pruner": "median", "wall_s": 50.0, "best": 0.91, "steps": 400},
    ]
    (line,) = compare(rows, ["none", "median"])
    assert line == (
        "pruner=median against pruner=none: 50% less wall time, 0.45x the training steps, "
        "best value +0.0000"
    )


def unpruned_study(tmp_path, curves):
    """A finished study as the sweeper leaves one, its trials reporting ``curves``."""
    import json

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "study.json").write_text(json.dumps({"study_name": "lr"}))
    study = optuna.create_study(
        study_name="lr", storage=f"sqlite:///{sweep / 'study.db'}", direction="maximize"
    )
    for curve in curves:
        trial = study.ask()
        for i, value in enumerate(curve, 1):
            trial.report(value, 10 * i)
        study.tell(trial, curve[-1])
    return sweep


def test_a_replay_stops_the_trials_the_pruner_would_have_stopped(tmp_path, capsys):
    from transformers_lab.bench.study import run_replay

    # median, 3 startup trials: the fourth is below the median (0.5) at its first report
    curves = [[0.5, 0.6, 0.7], [0.1, 0.1, 0.1], [0.6, 0.8, 0.9], [0.2, 0.2, 0.2]]
    lines = run_replay(unpruned_study(tmp_path, curves), ["none", "median"])
    assert lines[1:] == [
        "pruner=none: 120 steps (0% fewer), 0 pruned, best 0.9000",
        "pruner=median: 100 steps (17% fewer), 1 pruned, best 0.9000",
    ]
    assert main(["--replay", str(tmp_path / "sweep"), "--pruners", "asha", "hyperband"]) == 0
    out = capsys.readouterr().out  # every pruner option builds and replays
    assert "pruner=asha:" in out and "pruner=hyperband:" in out


def test_a_replay_needs_an_unpruned_study_and_known_pruners(tmp_path):
    import optuna

    from transformers_lab.bench.study import run_replay

    with pytest.raises(SystemExit, match="holds no study.json; give the sweep dir"):
        run_replay(tmp_path, ["median"])
    sweep = unpruned_study(tmp_path, [[0.5, 0.6]])
    with pytest.raises(SystemExit, match="unknown pruner 'sometimes'; valid options are: asha"):
        run_replay(sweep, ["sometimes"])
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{sweep / 'study.db'}")
    study.tell(study.ask(), state=optuna.trial.TrialState.PRUNED)
    with pytest.raises(SystemExit, match="replay a study run with pruner=none"):
        run_replay(sweep, ["median"])
