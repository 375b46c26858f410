"""Fastmax p=2 at long N: our Triton kernel (``attention.backend=triton``) against flash
softmax and fla's two ways to compute the same polynomial, forward and backward apart,
milliseconds and peak memory, causal, bf16, H=8, D=64 (docs/benchmarks.md)::

    python -m transformers_lab.bench.fastmax_gpu --out bench_out/fastmax_gpu   # a CUDA GPU
    python -m transformers_lab.bench.fastmax_gpu --dry-run                     # the plan
    make gpu-window ARGS="--only env fastmax_long"                              # in a window

The methods, each given the same bf16 q, k, v (B, H, N, D):

- ``sdpa``: softmax through PyTorch's SDPA, flash backend (``is_causal``);
- ``triton``: fastmax p=2 by our fused kernel, on unit queries and keys (``triton_ops``);
- ``fla_parallel_based``: fla's ``parallel_based``, the same polynomial, quadratic in N;
- ``fla_taylor_chunk``: fla's ``chunk_linear_attn`` on the 1 + D + D (D + 1) / 2 Taylor
  features of q and k (the engine's ``feature_map``), the same state as ours, written out.

Each (method, B, N) is warmed up once, then timed ``--repeats`` times (the median): the
forward alone, then forward and backward; backward is their difference. Peak memory is
``max_memory_allocated`` over one forward and backward, less the inputs'. A method that
runs out of memory, or whose forward and backward take longer than ``--slow-s``, is said
so and not run at larger N. ``--device cpu`` runs the same code on a CPU (Triton's
interpreter for ``triton``, no fla) at small N: the tests' check of this script.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

METHODS = ("sdpa", "triton", "fla_parallel_based", "fla_taylor_chunk")
BATCHES = (1, 8)
LENGTHS = (4096, 16384, 32768, 65536, 131072)


def fastmax_inputs(q, k):
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1)


def method(name: str) -> Callable:
    """``name``'s causal attention, (B, H, N, D) q, k, v -> (B, H, N, D)."""
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if name == "triton":
        from transformers_lab.attention.triton_ops import triton_fastmax

        return lambda q, k, v: triton_fastmax(*fastmax_inputs(q, k), v)[0]
    import importlib

    if name == "fla_parallel_based":
        based = importlib.import_module("fla.ops.based")

        def parallel(q, k, v):  # fla's Based ops take (B, N, H, D) and turn it back
            qn, kn = fastmax_inputs(q, k)
            o = based.parallel_based(qn.transpose(1, 2), kn.transpose(1, 2), v.transpose(1, 2),
                                     scale=1.0, use_norm=True)  # fmt: skip
            return o.transpose(1, 2)

        return parallel
    if name == "fla_taylor_chunk":
        linear = importlib.import_module("fla.ops.linear_attn")
        from transformers_lab.attention.feature_map.features import feature_map, feature_weights

        def taylor(q, k, v):
            qn, kn = fastmax_inputs(q, k)
            w = feature_weights(q.shape[-1], 2, q.dtype, q.device)
            fq, fk = feature_map(qn, 2), feature_map(kn, 2) * w
            fq, fk = (F.pad(t, (0, t.shape[-1] % 2)) for t in (fq, fk))  # even widths
            o, _ = linear.chunk_linear_attn(*(t.transpose(1, 2) for t in (fq, fk, v)),
                                            scale=1.0, normalize=True)  # fmt: skip
            return o.transpose(1, 2)

        return taylor
    raise ValueError(f"unknown method {name!r}; the methods are {', '.join(METHODS)}")


def clock(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds one call of a function takes on ``device`` (CUDA events on a GPU)."""

    def timed(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3

    return timed


def measure(name: str, b: int, n: int, args) -> dict[str, object]:
    """One row: forward and backward milliseconds (medians) and peak memory, or why not."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    row: dict[str, object] = {"method": name, "B": b, "N": n, "H": args.heads, "D": args.head_dim}
    try:
        fn = method(name)
        torch.manual_seed(0)
        shape = (b, args.heads, n, args.head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        dy = torch.randn(shape, device=device, dtype=dtype)

        def forward():
            with torch.no_grad():
                fn(q, k, v)

        def both():
            torch.autograd.grad(fn(q, k, v), (q, k, v), dy)

        timed = clock(device)
        first = timed(both)  # the warm-up: Triton compiles, fla autotunes
        if first / 1e3 > args.slow_s:
            return {**row, "status": f"slow: {first / 1e3:.1f} s a pass"}
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            both()
            row["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
        fwd = statistics.median(timed(forward) for _ in range(args.repeats))
        total = statistics.median(timed(both) for _ in range(args.repeats))
        row.update(fwd_ms=round(fwd, 3), bwd_ms=round(max(total - fwd, 0.0), 3), status="ok")
    except torch.cuda.OutOfMemoryError:
        row["status"] = "out of memory"
    except (ImportError, ValueError, RuntimeError) as exc:
        row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def table(rows: list[dict[str, object]]) -> str:
    """Markdown: a row per (B, N, method), each time also as a ratio to sdpa's."""
    sdpa = {(r["B"], r["N"]): r for r in rows if r["method"] == "sdpa" and r["status"] == "ok"}
    lines = ["| B | N | method | fwd ms | bwd ms | peak MiB | fwd / sdpa | bwd / sdpa | status |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["B"], r["N"], METHODS.index(r["method"]))):
        ref = sdpa.get((r["B"], r["N"]))
        ratios = [f"{r[c] / ref[c]:.2f}" if ref and r.get(c) and ref[c] else "" for c in
                  ("fwd_ms", "bwd_ms")]  # fmt: skip
        cells = [r["B"], r["N"], r["method"], r.get("fwd_ms", ""), r.get("bwd_ms", ""),
                 r.get("peak_mib", ""), *ratios, r["status"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformers_lab.bench.fastmax_gpu")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--batch", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--n", nargs="+", type=int, default=list(LENGTHS))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slow-s", type=float, default=5.0, help="stop a method past this")
    parser.add_argument("--out", type=Path, default=Path("bench_out/fastmax_gpu"))
    parser.add_argument("--dry-run", action="store_true", help="print the plan, time nothing")
    args = parser.parse_args(argv)
    plan = [(m, b, n) for b in args.batch for n in sorted(args.n) for m in args.methods]
    if args.dry_run:
        print(f"{len(plan)} measurements: methods {' '.join(args.methods)}, B {args.batch}, "
              f"N {sorted(args.n)}, H={args.heads}, D={args.head_dim}, {args.dtype}")  # fmt: skip
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU is visible; --dry-run shows the plan, --device cpu runs it "
              "on a CPU at small N", file=sys.stderr)  # fmt: skip
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows, stopped = [], set()
    for m, b, n in plan:
        if (m, b) in stopped:
            row = {"method": m, "B": b, "N": n, "status": "skipped (a smaller N stopped)"}
        else:
            row = measure(m, b, n, args)
            if row["status"] != "ok":
                stopped.add((m, b))
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        with (args.out / "fastmax_gpu.csv").open("w", newline="") as f:
            fields = ["method", "B", "N", "H", "D", "fwd_ms", "bwd_ms", "peak_mib", "status"]
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        (args.out / "fastmax_gpu.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
