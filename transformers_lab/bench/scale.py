"""Planning a run at the field's sizes: each ``size`` preset (conf/size/: 340m, 1b3) with
each kernel, composed as ``tlab-train`` composes it and built on the meta device (no
memory, no data): its parameters, its decoding state, its training FLOPs a token at its
context (``GPT.flops_per_token``: each kernel's own count) and the hours a billion tokens
takes on a named GPU, at its peak and at an assumed MFU.

Usage::

    python -m transformers_lab.bench.scale                                # 340m and 1b3
    python -m transformers_lab.bench.scale --sizes 340m --kernels softmax gla --gpu A100
    python -m transformers_lab.bench.scale --mfu 0.35 --out bench_out/scale

The hours are FLOPs a token x 1e9 / (the GPU's dense bf16 peak, ``PEAK_TFLOPS``, x MFU):
a plan, not a measurement; ``perf/mfu`` in a run's logs says what a run reached.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from transformers_lab.cli import fail

MODULE = "transformers_lab.bench.scale"
SIZES = ["340m", "1b3"]
# softmax with RoPE, and the gated family (each at the transformer's heads)
KERNELS = ["softmax", "retnet", "gla", "simple_gla", "deltanet", "gated_deltanet", "kda",
           "gated_deltaproduct", "rwkv7", "fox"]  # fmt: skip


def plan_row(size: str, kernel: str, gpu: str, mfu: float) -> dict:
    """One size with one kernel, built on the meta device."""
    from transformers_lab.config import compose_config
    from transformers_lab.run.callbacks.throughput import peak_of
    from transformers_lab.run.components import build_on_meta

    overrides = [f"size={size}", f"attention={kernel}", "data.sources=[plan.txt]"]
    cfg = compose_config("train", overrides, Path("/nonexistent/plan"))
    model = build_on_meta(cfg)
    context = int(cfg.data.block_size)
    flops = model.flops_per_token(context)
    _, peak = peak_of(gpu, None)
    hours = flops * 1e9 / peak / 3600
    params = sum(p.numel() for p in model.parameters())
    return {
        "size": size,
        "kernel": kernel,
        "params_m": params / 1e6,
        "state_k": model.state_size(context) / 1e3,
        "context": context,
        "gflops_token": flops / 1e9,
        "hours_at_peak": hours,
        "hours_at_mfu": hours / mfu,
        "tokens_b": float(cfg.trainer.max_tokens) / 1e9,
    }


def report(rows: Sequence[dict], gpu: str, mfu: float) -> str:
    lines = [
        f"| size | kernel | parameters | decoding state | GFLOPs a token | hours a 1B tokens on "
        f"one {gpu}: peak / at {mfu:.0%} MFU | the preset's budget on 8 {gpu}s at {mfu:.0%} |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        budget = r["hours_at_mfu"] * r["tokens_b"] / 8
        lines.append(
            f"| {r['size']} | {r['kernel']} | {r['params_m']:.1f}M | {r['state_k']:,.0f}k "
            f"| {r['gflops_token']:.2f} | {r['hours_at_peak']:.2f} / {r['hours_at_mfu']:.2f} "
            f"| {r['tokens_b']:g}B tokens: {budget:,.1f} h |"
        )
    lines.append("")
    lines.append(
        f"FLOPs a token: 6 a weight of each linear layer, plus the kernel's own count at the "
        f"context of {rows[0]['context'] if rows else '?'} tokens (softmax's pairs, causal; a "
        f"linear kernel's state work); the decoding state at that context, all layers (a KV "
        f"cache for softmax). The hours assume {mfu:.0%} of the {gpu}'s dense bf16 peak."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=SIZES, help="conf/size/ options")
    parser.add_argument("--kernels", nargs="+", default=KERNELS, help="attention options")
    parser.add_argument("--gpu", default="H100", help="a GPU of the peak table (PEAK_TFLOPS)")
    parser.add_argument("--mfu", type=float, default=0.4, help="the MFU assumed for the hours")
    parser.add_argument("--out", type=Path, default=None, help="write scale.md there too")
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1:
        fail(f"--mfu must be in (0, 1], got {args.mfu}")
    from transformers_lab.cli import user_errors
    from transformers_lab.run.callbacks.throughput import peak_of

    with user_errors():
        try:
            peak_of(args.gpu, None)
        except ValueError as exc:
            fail(f"--gpu: {exc}".replace("give callbacks.throughput.peak_tflops=", "one of"))
        rows = [plan_row(s, k, args.gpu, args.mfu) for s in args.sizes for k in args.kernels]
    text = report(rows, args.gpu, args.mfu)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
