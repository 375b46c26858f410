"""``bench.fastmax_gpu``, the long-N table of fastmax p=2 on our Triton kernel: run on a CPU
(Triton's interpreter) at small N, rows and table as a GPU would write them."""

from __future__ import annotations

import csv

import pytest

from transformers_lab.bench import fastmax_gpu

SMALL = ["--device", "cpu", "--dtype", "float32", "--batch", "1", "--heads", "2",
         "--head-dim", "16", "--repeats", "1"]  # fmt: skip


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton_cpu

    triton_cpu.interpret()


def test_the_table_times_forward_and_backward_apart_against_sdpa(interpreter, tmp_path):
    args = [*SMALL, "--methods", "sdpa", "triton", "--n", "32", "64", "--out", str(tmp_path)]
    assert fastmax_gpu.main(args) == 0
    rows = list(csv.DictReader((tmp_path / "fastmax_gpu.csv").open()))
    assert [(r["method"], r["N"]) for r in rows] == [
        ("sdpa", "32"), ("triton", "32"), ("sdpa", "64"), ("triton", "64")
    ]  # fmt: skip
    assert all(r["status"] == "ok" and float(r["fwd_ms"]) > 0 for r in rows), rows
    table = (tmp_path / "fastmax_gpu.md").read_text().splitlines()
    assert table[0].startswith("| B | N | method | fwd ms | bwd ms | peak MiB | fwd / sdpa")
    assert table[2].split(" | ")[6] == "1.00"  # sdpa against itself


def test_a_slow_method_is_said_so_and_not_run_at_larger_n(interpreter, tmp_path):
    args = [*SMALL, "--methods", "triton", "--n", "32", "64", "--slow-s", "0", "--out",
            str(tmp_path)]  # fmt: skip
    assert fastmax_gpu.main(args) == 0
    rows = list(csv.DictReader((tmp_path / "fastmax_gpu.csv").open()))
    assert rows[0]["status"].startswith("slow: ") and rows[1]["status"].startswith("skipped")
