"""The framework-overhead benchmark runs both sides on the same experiment."""

import csv
import json
import os
from pathlib import Path

import pytest

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
    seconds = {(r["side"], r["repeat"]): float(r["seconds"]) for r in rows}
    pairs = [seconds["tlab", i] / seconds["bare", i] for i in ("0", "1")]
    assert f"run by run (each pair back to back): {pairs[0]:.3f}, {pairs[1]:.3f}" in report


def test_pair_ratios_take_each_repeat_s_two_runs():
    rows = [
        {"side": "bare", "repeat": 0, "seconds": 10.0},
        {"side": "tlab", "repeat": 0, "seconds": 11.0},
        {"side": "tlab", "repeat": 1, "seconds": 30.0},
        {"side": "bare", "repeat": 1, "seconds": 20.0},
    ]
    assert training.pair_ratios(rows, "tlab", "bare") == [1.1, 1.5]


# a stand-in for nanoGPT's train.py: it checks the data files it would read, keeps the
# flags it was given, and prints its evaluation lines as nanoGPT does
FAKE_TRAIN = """
import json, os, pickle, sys
import numpy as np
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
meta = pickle.load(open("data/shakespeare_char/meta.pkl", "rb"))
train = np.fromfile("data/shakespeare_char/train.bin", dtype=np.uint16)
val = np.fromfile("data/shakespeare_char/val.bin", dtype=np.uint16)
assert 0 < len(val) < len(train) and train.max() < meta["vocab_size"], meta
with open(os.environ["FAKE_NANOGPT_FLAGS"], "a") as f:
    f.write(json.dumps(flags) + "\\n")
for it in range(0, int(flags["max_iters"]) + 1, int(flags["eval_interval"])):
    print(f"step {it}: train loss 4.0000, val loss {4.0 - it / 100:.4f}")
"""


@pytest.mark.slow  # over a minute on 2 cores: make test-slow
def test_training_bench_against_nanogpt_runs_both_processes_alike(tmp_path, monkeypatch, capsys):
    # tlab-train runs as its own process, which verifies the text against its real checksum
    text = Path(os.environ.get("TLAB_DATA_DIR", "/nonexistent")) / "shakespeare" / "input.txt"
    if not text.is_file():
        pytest.skip(f"needs the real Tiny Shakespeare at {text} (TLAB_DATA_DIR)")
    checkout = tmp_path / "nanoGPT"
    checkout.mkdir()
    (checkout / "train.py").write_text(FAKE_TRAIN)
    (checkout / "model.py").write_text("")
    (checkout / "configurator.py").write_text("")
    monkeypatch.setenv("FAKE_NANOGPT_FLAGS", str(tmp_path / "flags.jsonl"))
    small = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "data.block_size=16"]
    argv = ["--against", "nanogpt", "--nanogpt", str(checkout), "--steps", "6", "--repeats", "2"]
    argv += ["--eval-iters", "2", "--overrides", *small, "trainer.val_check_interval=3"]
    assert training.main([*argv, "--out", str(tmp_path / "out")]) == 0
    rows = list(csv.DictReader((tmp_path / "out" / "nanogpt.csv").open()))
    assert [r["side"] for r in rows] == ["nanogpt", "tlab-train", "tlab-train", "nanogpt"]
    assert all(float(r["seconds"]) > 0 and float(r["cpu_seconds"]) > 0 for r in rows)
    assert [float(r["val_loss"]) for r in rows if r["side"] == "nanogpt"] == [3.97, 3.97]
    # nanoGPT's last evaluation is before its last steps: the report says where each was
    assert {r["val_at"] for r in rows} == {"step 3", "end"}
    assert all(0 < float(r["val_loss"]) < 10 for r in rows if r["side"] == "tlab-train")
    flags = [json.loads(line) for line in (tmp_path / "flags.jsonl").read_text().splitlines()]
    assert len(flags) == 2 and flags[0] == flags[1]
    # the experiment's settings, nanoGPT's steps made equal to ours, and its evaluation size
    expected = {"max_iters": "5", "lr_decay_iters": "6", "eval_interval": "3", "eval_iters": "2"}
    expected |= {"n_layer": "1", "n_embd": "16", "n_head": "2", "block_size": "16"}
    expected |= {"device": "cpu", "compile": "False", "gradient_accumulation_steps": "1"}
    assert expected.items() <= flags[0].items()
    # each process's output is kept beside the report (its work dir is temporary)
    assert "val loss 3.9700" in (tmp_path / "out" / "nanogpt0.log").read_text()
    assert (tmp_path / "out" / "tlab-train1.log").stat().st_size > 0
    report = (tmp_path / "out" / "nanogpt.md").read_text()
    assert "tlab-train / nanoGPT wall time:" in report and "| nanogpt |" in report
    assert "3.9700 (step 3) |" in report and "(end) |" in report


def test_training_bench_against_nanogpt_needs_a_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        training.main(["--against", "nanogpt"])
    assert "--against nanogpt needs --nanogpt" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no train.py, model.py, configurator.py there"):
        training.main(["--against", "nanogpt", "--nanogpt", str(tmp_path), "--steps", "2"])
