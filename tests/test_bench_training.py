"""The framework-overhead benchmark runs both sides on the same experiment."""

import csv

from transformers_lab.bench import training

from fake_data import fake_data_root


def test_training_bench_compares_the_framework_with_a_bare_loop(tmp_path, monkeypatch, capsys):
    fake_data_root(tmp_path / "data", monkeypatch)
    small = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "data.block_size=16"]
    argv = ["--steps", "6", "--repeats", "2", "--overrides", *small, "trainer.val_check_interval=3"]
    assert training.main([*argv, "--out", str(tmp_path / "out")]) == 0
    rows = list(csv.DictReader((tmp_path / "out" / "training.csv").open()))
    assert [r["side"] for r in rows] == ["bare", "tlab", "tlab", "bare"]  # alternated
    assert all(float(r["seconds"]) > 0 and float(r["cpu_seconds"]) > 0 for r in rows)
    # same model, data, seed and steps: the two sides end at nearly the same loss
    losses = {r["side"]: float(r["val_loss"]) for r in rows}
    assert abs(losses["bare"] - losses["tlab"]) < 0.05 * losses["bare"]
    report = (tmp_path / "out" / "training.md").read_text()
    assert "framework / bare wall time:" in report and "bare CPU time:" in report
