"""The long-context training bench runs its workers and writes a well-formed report (its
figures come from the full run in the README, not from here)."""

from __future__ import annotations

import csv

import pytest

from transformers_lab.bench.long_context import COLUMNS, kernel_overrides, main, report


@pytest.mark.slow
def test_the_bench_trains_each_kernel_and_reports_tokens_per_second(tmp_path, capsys):
    tiny = ["data.block_size=128", "model.n_layer=1"]
    argv = ["--kernels", "softmax", "fastmax_p2", "linear_compiled", "--steps", "2",
            "--warmup", "1", "--out", str(tmp_path), "--overrides", *tiny]  # fmt: skip
    assert main(argv) == 0
    with open(tmp_path / "long_context.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == COLUMNS
    assert [r["kernel"] for r in rows] == ["softmax", "fastmax_p2", "linear_compiled"]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["context"] == "128" and float(row["tokens_per_s"]) > 0
        assert float(row["step_ms"]) > 0 and float(row["peak_mib"]) >= 0
    assert "| fastmax_p2 | 128 |" in (tmp_path / "long_context.md").read_text()


def test_the_report_divides_by_softmax_and_keeps_failures():
    rows = [
        {"repeat": 0, "kernel": "softmax", "context": 4096, "tokens_per_s": 1000.0,
         "step_ms": 4096.0, "peak_mib": 900.0, "status": "ok"},
        {"repeat": 0, "kernel": "linear", "context": 4096, "tokens_per_s": 3500.0,
         "step_ms": 1170.0, "peak_mib": 200.0, "status": "ok"},
        {"repeat": 1, "kernel": "linear", "context": 4096, "tokens_per_s": 2500.0,
         "step_ms": 1638.0, "peak_mib": 220.0, "status": "ok"},
        {"repeat": 0, "kernel": "based", "context": None, "tokens_per_s": None,
         "step_ms": None, "peak_mib": None, "status": "timeout"},
    ]  # fmt: skip
    text = report(rows, "# t")
    assert "| softmax | 4096 | 1000 | 4096 | 900 | 1.00 | ok |" in text
    assert "| linear | 4096 | 3000 | 1404 | 210 | 3.00 | ok |" in text  # medians of 2
    assert "| based |  | – | – | – | – | timeout |" in text


def test_a_compiled_variant_is_its_kernel_with_compiled_steps():
    assert kernel_overrides("fastmax_p2") == ["attention=fastmax_p2"]
    assert kernel_overrides("based_compiled") == ["attention=based", "attention.compiled=true"]


def test_an_unknown_kernel_is_named_with_the_valid_ones_and_only_the_linear_compile(capsys):
    """softmax_compiled is unknown (only kernels with compiled steps have a compiled
    variant); the error names the valid ones, fastmax_p2_compiled among them."""
    with pytest.raises(SystemExit):
        main(["--kernels", "linear_compiled", "softmax", "softmax_compiled"])
    err = capsys.readouterr().err
    assert "unknown kernel 'softmax_compiled'; valid: " in err and "fastmax_p2_compiled" in err
    assert "softmax_compiled," not in err.split("valid: ", 1)[1]
