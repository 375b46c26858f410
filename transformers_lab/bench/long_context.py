"""Long-context training speed: tokens per second and peak memory of
``experiment=gpt_long_context`` (a GPT on Tiny Shakespeare, context 4096) per kernel.

Usage::

    python -m transformers_lab.bench.long_context                     # softmax + the linear kernels
    python -m transformers_lab.bench.long_context --kernels softmax fastmax_p2 --steps 5
    python -m transformers_lab.bench.long_context --overrides data.block_size=8192
    python -m transformers_lab.bench.long_context --kernels softmax linear linear_compiled
    python -m transformers_lab.bench.long_context --kernels softmax relu2 --config-dir my_conf

A kernel is an attention option (the user's own with ``--config-dir``), ``<option>_compiled``,
or any other target of ``attention.resolve`` (a kernel yaml, a class path; its config then
replaces the experiment's attention, so ``--overrides attention.*`` do not reach it).
Each (kernel, repeat) runs in a fresh worker process (``--worker``), which composes the
experiment with ``attention=<kernel>``, builds its data module and model, and trains
``--steps`` optimizer steps (AdamW, gradient clipping) on the real batches after
``--warmup`` steps. It reports training tokens per second (batch x context / step time,
the median step) and the extra peak resident memory of one step over the process
before it (``VmHWM`` after a reset, as in ``bench.kernels``). The kernels'
order alternates from one repeat to the next, so drift in the machine's speed hits all.
Reports go to ``--out`` as ``long_context.csv`` and ``long_context.md``, with each
kernel's tokens/s over softmax's. ``<kernel>_compiled`` is a kernel with a ``compiled``
option run with ``attention.compiled=true``: its chunk steps through ``torch.compile``,
compiled in the warm-up steps, which are not timed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from transformers_lab.bench.kernels import (
    COMPILED,
    MIB,
    compiled_variants,
    error_status,
    proc_status_kib,
    reset_peak_rss,
    reuse_freed_memory,
    worker_env,
)
from transformers_lab.cli import fail

MODULE = "transformers_lab.bench.long_context"
KERNELS = ["softmax", "fastmax_p2", "fastmax_p1", "linear", "based", "performer", "cosformer"]
COLUMNS = ["repeat", "kernel", "context", "tokens_per_s", "step_ms", "peak_mib", "status"]


def measure(
    kernel: str,
    steps: int,
    warmup: int,
    overrides: Sequence[str],
    config: dict | None = None,
) -> dict:
    """Train ``warmup + steps`` steps of the experiment with ``kernel`` in this process:
    an attention option (``overrides`` may put the user's config dirs on
    ``hydra.searchpath``), or, given its kernel ``config``, any other target."""
    import lightning as L

    from transformers_lab.bench.training import train_step
    from transformers_lab.config import compose_config
    from transformers_lab.nn import weight_decay_groups
    from transformers_lab.run.components import build_datamodule, build_model

    with tempfile.TemporaryDirectory() as tmp:
        chosen = [] if config else kernel_overrides(kernel)
        cfg = compose_config("train", ["experiment=gpt_long_context", *chosen, *overrides], tmp)
    if config:  # a yaml or a class path: the model's ${attention} reads it
        cfg.attention = config
    if "max_len" in cfg.attention:  # a positional kernel (cosformer): positions up to N
        cfg.attention.max_len = max(cfg.attention.max_len, cfg.data.block_size)
    L.seed_everything(cfg.seed)
    datamodule = build_datamodule(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    model = build_model(cfg.model, datamodule)
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model, cfg.optimizer.weight_decay),
        lr=cfg.optimizer.lr,
        betas=tuple(cfg.optimizer.betas),
    )
    clip = cfg.trainer.gradient_clip_val
    batches = iter(datamodule.train_dataloader())
    model.train()

    def step() -> float:
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(datamodule.train_dataloader())
            x, y = next(batches)
        start = time.perf_counter()
        train_step(model, optimizer, x, y, clip)
        return time.perf_counter() - start

    for _ in range(warmup):
        step()
    # the peak of one step, while freed buffers go back to the OS; then the timing, with
    # glibc keeping them for reuse as it usually does
    reset = reset_peak_rss()
    before = proc_status_kib("VmRSS") or 0
    step()
    peak = (proc_status_kib("VmHWM") or 0) - before if reset else None
    reuse_freed_memory()
    seconds = [step() for _ in range(steps)]
    tokens = cfg.data.batch_size * cfg.data.block_size
    median = statistics.median(seconds)
    return {
        "kernel": kernel,
        "context": int(cfg.data.block_size),
        "tokens_per_s": tokens / median,
        "step_ms": 1e3 * median,
        "peak_mib": None if peak is None else max(0, peak) * 1024 / MIB,
        "status": "ok",
    }


def kernel_overrides(kernel: str) -> list[str]:
    """The overrides that select ``kernel``: ``attention=<kernel>``, or for
    ``<base>_compiled`` the base kernel with its chunk steps compiled."""
    if kernel.endswith(COMPILED):
        return [f"attention={kernel.removesuffix(COMPILED)}", "attention.compiled=true"]
    return [f"attention={kernel}"]


def valid_kernels(dirs: Sequence[Path]) -> list[str]:
    """Every ``attention`` option of ``dirs`` (``conf/`` and the user's config dirs), and
    ``<option>_compiled`` for those with a ``compiled`` option (the linear kernels)."""
    from transformers_lab.config import attention_configs

    configs = attention_configs(dirs)
    return [*configs, *compiled_variants(configs)]


def kernel_configs(kernels: Sequence[str], dirs: Sequence[Path]) -> dict[str, dict | None]:
    """Each kernel -> None for an attention option (composed as ``attention=<name>``),
    else its kernel config (a yaml, a registered kernel, a class path); a ValueError
    naming the valid ones for a kernel that is neither."""
    from transformers_lab.attention.resolve import UnknownKernel, kernel_config

    valid = valid_kernels(dirs)
    configs: dict[str, dict | None] = {}
    for kernel in kernels:
        try:
            configs[kernel] = None if kernel in valid else kernel_config(kernel, dirs)
        except UnknownKernel:
            raise ValueError(
                f"unknown kernel {kernel!r}; valid: {', '.join(valid)}, a kernel yaml or a "
                "class as package.module.Class (your own options: --config-dir DIR)"
            ) from None
    return configs


def run_worker(kernel: str, args: argparse.Namespace) -> dict:
    """``measure`` in a fresh process; a crash or timeout becomes a status row."""
    from transformers_lab.config import searchpath_override

    spec = {"kernel": kernel, "steps": args.steps, "warmup": args.warmup,
            "overrides": [*searchpath_override(args.dirs), *args.overrides],
            "config": args.configs[kernel]}  # fmt: skip
    command = [sys.executable, "-m", MODULE, "--worker", json.dumps(spec)]
    empty = {"kernel": kernel, "context": None, "tokens_per_s": None, "step_ms": None,
             "peak_mib": None}  # fmt: skip
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=args.timeout, env=worker_env()
        )
    except subprocess.TimeoutExpired:
        return {**empty, "status": "timeout"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return {**empty, "status": error_status(tail[0])}


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        row = measure(
            spec["kernel"], spec["steps"], spec["warmup"], spec["overrides"], spec["config"]
        )
    except Exception as exc:  # any failure is a row, never a crash of the run
        row = {"kernel": spec["kernel"], "status": error_status(f"{type(exc).__name__}: {exc}")}
    print(json.dumps(row), flush=True)
    return 0


def report(rows: Sequence[dict], header: str) -> str:
    """The markdown report: per kernel the median over repeats, and the ratio to softmax."""
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))

    def median(kernel: str, key: str) -> float | None:
        values = [r[key] for r in rows if r["kernel"] == kernel and r["status"] == "ok"]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    base = median("softmax", "tokens_per_s")
    lines = [header, "", "| kernel | context | tokens/s | step (ms) | extra peak (MiB) | "
             "tokens/s ÷ softmax | status |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for kernel in kernels:
        tps = median(kernel, "tokens_per_s")
        statuses = sorted({r["status"] for r in rows if r["kernel"] == kernel})
        context = next(
            (r["context"] for r in rows if r["kernel"] == kernel and r.get("context")), ""
        )
        cells = [
            kernel,
            context,
            "–" if tps is None else f"{tps:.0f}",
            "–" if tps is None else f"{median(kernel, 'step_ms'):.0f}",
            "–" if median(kernel, "peak_mib") is None else f"{median(kernel, 'peak_mib'):.0f}",
            "–" if tps is None or not base else f"{tps / base:.2f}",
            ", ".join(statuses),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", nargs="+", default=KERNELS)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker")
    parser.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides for all")
    parser.add_argument("--out", type=Path, default=Path("bench_out/long_context"))
    parser.add_argument(
        "--config-dir", action="append", default=[], metavar="DIR", help="a config dir of yours"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    from transformers_lab.attention.resolve import config_dirs

    try:
        args.dirs = config_dirs(args.config_dir)
        args.configs = kernel_configs(args.kernels, args.dirs)
    except ValueError as exc:
        fail(str(exc))  # one line: the kernel named and the valid ones
    rows = []
    for repeat in range(args.repeats):
        order = args.kernels if repeat % 2 == 0 else list(reversed(args.kernels))
        for kernel in order:
            row = {"repeat": repeat, **run_worker(kernel, args)}
            rows.append(row)
            shown = {k: row.get(k) for k in COLUMNS}
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in shown.items()), flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "long_context.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    header = (
        f"# experiment=gpt_long_context: training tokens/s and peak memory; {args.steps} "
        f"timed steps after {args.warmup}, {args.repeats} repeat(s), "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads; overrides: "
        f"{' '.join(args.overrides) or 'none'}"
    )
    text = report(rows, header)
    (args.out / "long_context.md").write_text(text)
    print(text)
    print(f"report: {args.out / 'long_context.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
