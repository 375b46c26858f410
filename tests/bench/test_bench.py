"""The kernel benchmark: a tiny end-to-end run, argument checks and the reports."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from transformers_lab.attention import KERNELS
from transformers_lab.bench.kernels import cli, report, runner, specs, worker


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # over a minute on 2 cores: make test-slow
def test_end_to_end_tiny_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One causal mode keeps this to five worker processes (each one imports torch).
    argv = [
        "--n",
        "64",
        "128",
        "--kernels",
        "softmax",
        "fastmax_p2",
        "additive",
        "--repeats",
        "1",
        "--quadratic-max-n",
        "64",
        "--causal",
        "causal",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0

    rows = read_csv(tmp_path / "kernels.csv")
    assert list(rows[0]) == list(specs.COLUMNS)
    by_key = {(r["variant"], r["n"]): r for r in rows}
    expected = {(v, n) for v in ("softmax", "fastmax_p2", "additive") for n in ("64", "128")}
    assert set(by_key) == expected and len(rows) == len(expected)
    assert all(r["causal"] == "True" and r["device"] == "cpu" for r in rows)

    skipped = by_key[("additive", "128")]
    assert skipped["status"].startswith("skipped")
    assert skipped["time_ms"] == "" and skipped["peak_mib"] == ""
    for key, row in by_key.items():
        if key == ("additive", "128"):
            continue
        assert row["status"] == "ok", row
        assert float(row["time_ms"]) > 0
        peak = float(row["peak_mib"])
        assert math.isfinite(peak) and peak >= 0
        assert row["mem_method"] and row["timing"] == specs.OWN_PROCESS
        assert float(row["matmul_ms"]) >= 0  # on cpu, always measured (0 where SDPA has none)

    md = tmp_path / "kernels.md"
    png = tmp_path / "kernels.png"
    assert md.stat().st_size > 0 and png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| fastmax_p2 | causal | 128 |" in out
    assert "time ÷ softmax" in out
    assert str(md) in out


def test_unknown_variant_lists_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["--kernels", "softmax", "flashy"])
    assert excinfo.value.code != 0
    err = capsys.readouterr().err
    assert "'flashy'" in err
    for name in specs.variants():
        assert name in err

    with pytest.raises(ValueError, match="valid variants are: softmax, additive, "):
        specs.variant_configs(["nope"])


def test_plan_and_skips() -> None:
    args = cli.parse_args(["--n", "128", "64", "--kernels", "additive", "softmax"])
    planned = runner.plan(args)
    assert [(s.causal, s.variant, s.n) for s in planned[:4]] == [
        (True, "additive", 64),
        (True, "additive", 128),
        (True, "softmax", 64),
        (True, "softmax", 128),
    ]
    assert len(planned) == 8
    big = specs.Spec("fastmax_p2_quadratic", causal=False, n=8192)
    assert runner.skip_reason(big, 4096, {}) is not None
    assert runner.skip_reason(specs.Spec("fastmax_p2", causal=False, n=8192), 4096, {}) is None
    timed_out = {("fastmax_p2", False): 4096}
    reason = runner.skip_reason(specs.Spec("fastmax_p2", causal=False, n=8192), 4096, timed_out)
    assert reason is not None and "timed out" in reason


def test_timeout_becomes_a_row() -> None:
    spec = specs.Spec("softmax", causal=True, n=64, repeats=1)
    row = runner.run_worker(spec, timeout=0.05)  # far less than importing torch takes
    assert row["status"] == "timeout"
    assert row["time_ms"] is None and row["peak_mib"] is None


def test_measure_once_in_process() -> None:
    row = worker.measure_once(specs.Spec("fastmax_p1", causal=False, n=32, repeats=1))
    assert row["status"] == "ok" and row["time_ms"] > 0 and row["peak_mib"] >= 0
    assert row["matmul_ms"] > 0  # its state and its reads are matrix products


@pytest.mark.parametrize("variant", ["fastmax_p2_fused", "fastmax_p2_short_conv"])
def test_the_layer_variants_take_q_k_v_from_one_fused_projection(variant, monkeypatch) -> None:
    seen = []
    real = worker.fwd_bwd_fused

    def spy(kernel, conv, x, spec, gates=None):
        seen.append((x.shape, conv))
        real(kernel, conv, x, spec, gates)

    monkeypatch.setattr(worker, "fwd_bwd_fused", spy)
    row = worker.measure_once(specs.Spec(variant, causal=True, n=32, repeats=1))
    assert row["status"] == "ok" and row["time_ms"] > 0
    assert seen and seen[-1][0] == (1, 32, 3 * 4 * 32)  # (B, N, 3 H D)
    conv = seen[-1][1]
    assert (conv is None) == (variant == "fastmax_p2_fused")
    assert conv is None or conv.width == 4


@pytest.mark.parametrize("variant", ["gla", "gated_deltanet"])
def test_a_gated_kernel_is_timed_with_its_gate_inputs(variant, monkeypatch) -> None:
    """The gates its layer would project from x are drawn, passed and given gradients
    (gla: bare q, k, v; gated_deltanet's preset: through its short convolution)."""
    seen = []
    real_plain, real_fused = worker.fwd_bwd, worker.fwd_bwd_fused

    def plain(kernel, q, k, v, causal, gates=None):
        real_plain(kernel, q, k, v, causal, gates)
        seen.append(gates)

    def fused(kernel, conv, x, spec, gates=None):
        real_fused(kernel, conv, x, spec, gates)
        seen.append(gates)

    monkeypatch.setattr(worker, "fwd_bwd", plain)
    monkeypatch.setattr(worker, "fwd_bwd_fused", fused)
    row = worker.measure_once(specs.Spec(variant, causal=True, n=40, repeats=1))
    assert row["status"] == "ok" and row["time_ms"] > 0
    names = set(KERNELS[variant].gate_inputs)
    assert seen and set(seen[-1]) == names
    assert all(g.grad is not None and g.shape[:3] == (1, 4, 40) for g in seen[-1].values())


def test_rounds_are_interleaved_and_each_row_is_the_median_round(monkeypatch) -> None:
    times = iter([5.0, 50.0, 1.0, 30.0, 3.0, 10.0])  # a, b, a, b, a, b
    order = []

    def fake(spec, timeout):
        order.append(spec.variant)
        return spec.row(time_ms=next(times), peak_mib=1.0)

    monkeypatch.setattr(runner, "run_worker", fake)
    args = cli.parse_args(["--n", "64", "--causal", "causal", "--kernels", "softmax",
                             "fastmax_p2", "--rounds", "3"])  # fmt: skip
    rows = runner.run_bench(args)
    assert order == ["softmax", "fastmax_p2"] * 3
    assert [(r["variant"], r["time_ms"]) for r in rows] == [("softmax", 3.0), ("fastmax_p2", 30.0)]


def test_paired_times_alternate_the_variants_in_one_process(monkeypatch, capsys) -> None:
    pair = [specs.Spec(v, causal=True, n=32, repeats=3) for v in ("fastmax_p2", "softmax")]
    calls = []
    real = worker.timed
    monkeypatch.setattr(worker, "timed", lambda run, device: calls.append(run) or real(run, device))
    assert worker.worker_main(json.dumps([asdict(s) for s in pair])) == 0
    times = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(times) == ["fastmax_p2", "softmax"] and all(t > 0 for t in times.values())
    assert len(calls) == 6 and calls[0] is not calls[1] and calls[0] is calls[2]  # a, b, a, ...


@pytest.mark.slow  # over a minute on 2 cores: make test-slow
def test_a_paired_run_reports_paired_times(tmp_path: Path) -> None:
    argv = ["--n", "32", "--causal", "causal", "--kernels", "softmax", "fastmax_p2",
            "--repeats", "1", "--paired", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    rows = read_csv(tmp_path / "kernels.csv")
    assert [r["timing"] for r in rows] == [specs.PAIRED, specs.PAIRED]
    assert all(float(r["time_ms"]) > 0 and float(r["peak_mib"]) >= 0 for r in rows)
    assert "timed in one process, their passes alternated" in (tmp_path / "kernels.md").read_text()


def test_the_matmul_time_counts_matrix_products_only() -> None:
    a, b = torch.randn(64, 256, 256), torch.randn(64, 256, 256)
    assert worker.matmul_time_ms(lambda: a + b) == 0.0
    many = worker.matmul_time_ms(lambda: [torch.bmm(a, b) for _ in range(8)])
    one = worker.matmul_time_ms(lambda: torch.bmm(a, b))
    assert many > 2 * one > 0


def test_reports_cover_failures_and_both_modes(tmp_path: Path) -> None:
    rows = []
    for causal in (True, False):
        for n, scale in ((256, 1.0), (512, 2.0)):
            rows.append(
                specs.Spec("softmax", causal, n).row(
                    time_ms=1.0 * scale, peak_mib=2.0 * scale, mem_method="vmhwm"
                )
            )
            rows.append(
                specs.Spec("fastmax_p2", causal, n).row(
                    time_ms=3.0 * scale, peak_mib=1.0 * scale, mem_method="vmhwm"
                )
            )
        rows.append(specs.Spec("additive", causal, 256).row(status="timeout"))
        rows.append(specs.Spec("additive", causal, 512).row(status="error: boom"))

    paths = report.write_reports(rows, tmp_path / "nested")
    assert all(p.stat().st_size > 0 for p in paths.values())
    md = paths["md"].read_text()
    assert "## Ratios, causal" in md and "## Ratios, non-causal" in md
    # fastmax_p2 at 512: 6 ms vs 2 ms for softmax, 2 MiB vs 4 MiB, and 2x its memory at 256.
    assert "| 512 | fastmax_p2 | 3.00 | 0.50 | 2.00 |" in md
    # decode state: a KV cache of H N (D + Dv) = 4 * 512 * 64; fastmax's, the same at any N
    assert "| additive | noncausal | 512 | – | – | 131,072 | – | – | – | – | error: boom |" in md
    fastmax = {r["n"]: r["state_numbers"] for r in rows if r["variant"] == "fastmax_p2"}
    assert fastmax[256] == fastmax[512] == 4 * 33 * (33 * 17)  # H (Dv + 1) F, F = 561
    assert len(read_csv(paths["csv"])) == len(rows)


def test_the_flop_bound_is_the_linear_kernels_flops_at_the_matmul_rate(tmp_path: Path) -> None:
    fastmax = specs.Spec("fastmax_p2", False, 512).row(time_ms=30.0, peak_mib=1.0, matmul_ms=15.0)
    softmax = specs.Spec("softmax", False, 512).row(time_ms=10.0, peak_mib=1.0)
    # non-causal: 12 F (Dv + 1) per token and head, F = 561, Dv + 1 = 33
    assert fastmax["gflop"] == pytest.approx(12 * 561 * 33 * 512 * 4 / 1e9)
    assert softmax["gflop"] is None  # SDPA has no bound of this kind
    rate = fastmax["gflop"] / 10e-3  # GFLOP/s that make the bound 10 ms: 3x it
    md = report.write_reports([softmax, fastmax], tmp_path, rate=rate)["md"].read_text()
    assert f"rate, {rate:.0f} GFLOP/s" in md
    row = "| fastmax_p2 | noncausal | 512 | 30.0 | 1.00 | 74,052 | 10.0 | 3.00 | 15.0 | 1.50 | ok |"
    assert row in md
    assert "| softmax | noncausal | 512 | 10.0 | 1.00 | 131,072 | – | – | – | – | ok |" in md


def test_the_matmul_rate_is_measured() -> None:
    rate = worker.matmul_rate(size=256)
    assert math.isfinite(rate) and rate > 0.1


def test_every_linear_kernel_has_a_compiled_variant_left_out_by_default() -> None:
    found = specs.variants()
    compiled = sorted(name for name in found if name.endswith("_compiled"))
    assert compiled == [
        "based_compiled", "cosformer_compiled", "fastmax_p1_compiled", "fastmax_p2_compiled",
        "linear_compiled", "performer_compiled",
    ]  # fmt: skip
    assert found["linear_compiled"] == {**found["linear"], "compiled": True}
    assert found["linear"]["compiled"] is False
    assert not set(compiled) & set(specs.default_variants())
    assert "linear" in specs.default_variants()


def test_a_causal_only_kernel_is_skipped_where_the_bench_times_noncausal() -> None:
    reason = runner.skip_reason(specs.Spec("gla", causal=False, n=64), 1 << 30, {})
    assert reason == "skipped (causal only)"
    assert runner.skip_reason(specs.Spec("gla", causal=True, n=64), 1 << 30, {}) is None
    assert runner.skip_reason(specs.Spec("linear", causal=False, n=64), 1 << 30, {}) is None
