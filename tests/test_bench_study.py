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
