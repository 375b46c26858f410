"""The parent: every measurement the arguments ask for, each in a fresh worker process
(``--in-process``: all in this one, CUDA), skipped where it cannot or need not run,
repeated over ``--rounds`` and, with ``--paired``, timed once more beside the others."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_class

from transformers_lab.bench.kernels.report import is_ok, write_csv
from transformers_lab.bench.kernels.specs import CAUSAL_MODES, PAIRED, QUADRATIC_VARIANTS, Row, Spec
from transformers_lab.bench.kernels.worker import error_status, measure_or_error

MODULE = "transformers_lab.bench.kernels"  # what a worker runs with ``python -m``
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def worker_env() -> dict[str, str]:
    """The environment of a worker: ours (OMP_NUM_THREADS included) plus the malloc knob."""
    env = dict(os.environ, **WORKER_ENV)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(PROJECT_ROOT) + (os.pathsep + path if path else "")
    return env


def call_worker(payload: Any, timeout: float) -> tuple[Any, subprocess.CompletedProcess | None]:
    """Run a worker process on ``payload`` (a spec's fields, or a list of them): the last
    JSON object it printed (None if none), and the process (None if it timed out)."""
    command = [sys.executable, "-m", MODULE, "--worker", json.dumps(payload)]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=worker_env()
        )
    except subprocess.TimeoutExpired:
        return None, None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), proc
            except json.JSONDecodeError:
                break
    return None, proc


def run_worker(spec: Spec, timeout: float) -> Row:
    """Measure ``spec`` in a fresh process; timeouts and crashes become status rows."""
    row, proc = call_worker(asdict(spec), timeout)
    if proc is None:
        return spec.row(status="timeout")
    if row is not None:
        return row
    if proc.returncode < 0:
        reason = f"worker killed by signal {-proc.returncode}"
        if proc.returncode == -9:
            reason += " (out of memory?)"
    else:
        reason = f"worker exited with code {proc.returncode}"
    tail = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else []
    return spec.row(status=error_status(": ".join([reason, *tail])))


def run_paired(rows: list[Row], specs: Sequence[Spec], timeout: float) -> list[Row]:
    """``rows`` with the time of every ok row replaced by its paired time: the ok variants
    of each (causal mode, N) timed in one fresh worker, their passes alternated
    (``paired_times``). Where that worker fails, the rows keep their own times, and a line
    on stderr says why."""
    groups: dict[tuple[bool, int], list[int]] = {}
    for i, row in enumerate(rows):
        if is_ok(row):
            groups.setdefault((row["causal"], row["n"]), []).append(i)
    rows = list(rows)
    for (causal, n), index in groups.items():
        if len(index) < 2:
            continue
        mode = "causal" if causal else "noncausal"
        times, proc = call_worker([asdict(specs[i]) for i in index], timeout * len(index))
        if times is None:
            times = {"error": "timed out" if proc is None else proc.stderr.strip()[-200:]}
        if "error" in times:
            print(f"paired timing of {mode} n={n} failed, own times kept: {times['error']}",
                  file=sys.stderr, flush=True)  # fmt: skip
            continue
        for i in index:
            rows[i] = {**rows[i], "time_ms": times[rows[i]["variant"]], "timing": PAIRED}
        print(f"paired {mode} n={n}: " + ", ".join(f"{v} {t:.2f} ms" for v, t in times.items()),
              file=sys.stderr, flush=True)  # fmt: skip
    return rows


def plan(args: argparse.Namespace) -> list[Spec]:
    """Every measurement the arguments ask for: causal mode, then variant, then N."""
    return [
        Spec(
            variant=variant,
            causal=causal,
            n=n,
            batch=args.batch,
            heads=args.heads,
            head_dim=args.head_dim,
            dtype=args.dtype,
            device=args.device,
            repeats=args.repeats,
            config=args.configs[variant],
        )
        for causal in CAUSAL_MODES[args.causal]
        for variant in args.kernels
        for n in sorted(set(args.n))
    ]


def skip_reason(
    spec: Spec, quadratic_max_n: int, timed_out_at: dict[tuple[str, bool], int]
) -> str | None:
    """Why ``spec`` is not measured, or None when it is."""
    target = spec.kernel_config.get("_target_")
    if not spec.causal and target and getattr(get_class(target), "causal_only", False):
        return "skipped (causal only)"
    if spec.variant in QUADRATIC_VARIANTS and spec.n > quadratic_max_n:
        return f"skipped (n > quadratic-max-n={quadratic_max_n})"
    smaller = timed_out_at.get((spec.variant, spec.causal))
    if smaller is not None:
        return f"skipped (timed out at n={smaller})"  # or, in process, took too long there
    return None


def measure_here(spec: Spec, timeout: float) -> Row:
    """Measure ``spec`` in this process (``--in-process``, CUDA: its allocator's peak is
    the pass's own whatever ran before); a failure or running out of memory is an error
    row. Nothing is interrupted here: ``too_slow`` reads ``timeout`` from the times."""
    row = measure_or_error(spec)
    gc.collect()
    if spec.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def too_slow(row: Row, spec: Spec, timeout: float) -> bool:
    """A measured row whose passes (the peak's, the warm-up and the repeats) took more
    than ``timeout`` seconds: the variant's next N, longer, is not measured in process."""
    return row["time_ms"] is not None and row["time_ms"] * (spec.repeats + 2) > 1e3 * timeout


def run_bench(args: argparse.Namespace) -> list[Row]:
    """Run every measurement of ``args`` (progress on stderr) and return the rows: with
    ``--rounds R``, each measurement R times in fresh workers, the rounds interleaved
    (every variant, then every variant again), and each row the round of median time.
    ``--in-process`` measures them all in this process instead (CUDA), N by N."""
    specs = plan(args)
    if args.in_process:  # N by N, so that a slow variant is dropped before its longest N
        specs = sorted(specs, key=lambda s: (not s.causal, s.n))
    measure = measure_here if args.in_process else run_worker
    timed_out_at: dict[tuple[str, bool], int] = {}
    runs: list[list[Row]] = [[] for _ in specs]
    total = len(specs) * args.rounds
    for r in range(args.rounds):
        for i, spec in enumerate(specs):
            reason = skip_reason(spec, args.quadratic_max_n, timed_out_at)
            row = spec.row(status=reason) if reason else measure(spec, args.timeout)
            slow = args.in_process and too_slow(row, spec, args.timeout)
            if row["status"] == "timeout" or slow:
                timed_out_at[(spec.variant, spec.causal)] = spec.n
            runs[i].append(row)
            done = r * len(specs) + i + 1
            print(f"[{done}/{total}] {describe(row)}", file=sys.stderr, flush=True)
            if getattr(args, "out", None) is not None:  # the rows so far: a stopped run keeps them
                args.out.mkdir(parents=True, exist_ok=True)
                write_csv([rows[-1] for rows in runs if rows], args.out / "kernels.csv")
    rows = [median_round(rows) for rows in runs]
    return run_paired(rows, specs, args.timeout) if args.paired else rows


def median_round(rows: list[Row]) -> Row:
    """Of one measurement's rounds, the ok round of median time (the lower of the two
    middle ones); the first round where none is ok."""
    ok = sorted((row for row in rows if is_ok(row)), key=lambda row: row["time_ms"])
    if not ok:
        return rows[0]
    return ok[(len(ok) - 1) // 2]


def describe(row: Row) -> str:
    """One progress line for a row."""
    mode = "causal" if row["causal"] else "noncausal"
    head = f"{row['variant']:<21} {mode:<9} n={row['n']:<6}"
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    return f"{head} {row['time_ms']:10.2f} ms {row['peak_mib']:10.2f} MiB"
