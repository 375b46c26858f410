"""The prepared GPU window (``make gpu-window``): its steps walked without a GPU
(``--dry-run``), its bench's variants, and the autotune cache it carries between windows."""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path

import pytest
import torch

from transformers_lab.bench import gpu_window
from transformers_lab.bench import kernels as bench


@pytest.mark.slow  # every step's commands walked in subprocesses (make test-slow)
def test_a_dry_run_walks_every_step_in_order_and_writes_the_results(tmp_path, capsys):
    steps = gpu_window.steps(tmp_path)
    plan = [s for s in steps if s.default]
    assert [s.name for s in plan] == ["env", "bench_4096", "bench_16384", "bench_65536",
                                      "gpu_tests", "bf16_backends"]  # fmt: skip
    assert sum(s.limit_s for s in plan) <= 600  # one call of a lent machine
    (long,) = [s for s in steps if not s.default]  # run only when named, in a call of its own
    assert long.name == "fastmax_long" and 30 + long.limit_s <= 600
    # the last step collects the tests the one before it leaves out (-k "not backend"):
    # walked here by that one, whose collection counts them as deselected
    assert plan[-1].command[:-2] == [c for c in plan[-2].command if c not in ("-n", "8")][:-2]
    assert plan[-1].command[-2:] == ["-k", "backend"] and plan[-2].command[-1] == "not backend"
    walked = [s.name for s in plan[:-1]] + ["fastmax_long"]
    assert gpu_window.main(["--dry-run", "--out", str(tmp_path), "--only", *walked]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [s["step"] for s in results["steps"]] == walked
    assert all(s["status"] == "dry-run ok" for s in results["steps"]), results["steps"]
    env = json.loads(results["steps"][0]["summary"])
    assert gpu_window.pinned() == {"fla-core": "0.6.0", "triton": "3.8.0"}  # pyproject's
    assert env["fla-core"] == "0.6.0" and env["cache_fits"] is True
    collected = re.search(r"(\d+)/\d+ tests collected \((\d+) deselected\)",
                          results["steps"][-2]["summary"])  # fmt: skip
    assert results["steps"][-1]["summary"].startswith("40 measurements: methods sdpa triton")
    assert collected and int(collected[1]) > 0 and int(collected[2]) > 0  # both steps' tests


def test_the_bench_times_each_covered_kernel_on_our_loop_and_each_of_its_backends():
    names = gpu_window.bench_kernels()
    assert names[0] == "softmax"
    found = bench.variants()
    for name in ("linear", "based", "fastmax_p1", "fastmax_p2"):
        assert {f"{name}_loop", f"{name}_fla", f"{name}_fla_op"} <= set(names)
    assert {"fastmax_p2_flex", "fastmax_p2_triton", "sliding_window_loop"} <= set(names)
    assert "sliding_window_flex" in names and "fastmax_p1_triton" not in names
    for gated in ("retnet", "gla", "simple_gla", "deltanet", "gated_deltanet"):
        assert {f"{gated}_loop", f"{gated}_fla"} <= set(names)
    assert set(names) <= set(found)
    step = gpu_window.steps(gpu_window.PROJECT_ROOT)[1]
    args = bench.build_parser().parse_args(step.command[3:])
    assert args.n == [4096] and args.device == "cuda" and args.dtype == "bfloat16"


def test_without_a_gpu_the_window_says_so_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")
    assert gpu_window.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: no CUDA GPU is visible; run this on a GPU machine, or --dry-run to "
                   "walk the steps here"]  # fmt: skip
    assert gpu_window.main(["--dry-run", "--only", "bench_9", "--out", str(tmp_path)]) == 2
    assert "unknown step(s) bench_9" in capsys.readouterr().err


def test_only_the_autotune_files_travel_and_come_back_where_triton_looks(tmp_path):
    cache, saved = tmp_path / "cache", tmp_path / "saved"
    for key, kernel in (("abc123", "chunk_fwd"), ("def456", "based_bwd")):
        (cache / key).mkdir(parents=True)
        (cache / key / f"{kernel}.autotune.json").write_text(json.dumps({"key": key}))
        (cache / key / f"{kernel}.cubin").write_bytes(b"\0" * 64)  # compiled code stays
    archive = tmp_path / "autotune.tar.gz"
    assert gpu_window.save_autotune(cache, saved, archive) == 2
    files = sorted(str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file())
    assert files == ["abc123/chunk_fwd.autotune.json", "def456/based_bwd.autotune.json"]
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == files
    fresh = tmp_path / "fresh"
    assert gpu_window.restore_autotune(saved, fresh) == 2
    assert json.loads((fresh / "def456" / "based_bwd.autotune.json").read_text()) == {
        "key": "def456"
    }
    assert gpu_window.restore_autotune(tmp_path / "none", fresh) == 0


def test_a_step_past_its_limit_is_stopped_with_its_children(tmp_path):
    """A step that runs past its limit is stopped, the processes it started too (pytest's
    workers in a window), and the window goes on."""
    import os
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    step = gpu_window.Step("slow", [sys.executable, "-c", script], 2, "sleeps")
    start = time.monotonic()
    status, _ = gpu_window.run_step(step, tmp_path / "window.log", dict(os.environ))
    assert status == "stopped at its limit of 2 s" and time.monotonic() - start < 20
    child = Path(f"/proc/{int(pid_file.read_text())}/stat")
    time.sleep(0.2)  # gone, or a zombie waiting for init to reap it: not running on
    assert not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] in "ZX"
