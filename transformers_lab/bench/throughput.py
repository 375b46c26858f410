"""Training throughput on this machine: tokens a second of ``experiment=baby_gpt`` on one
process and on two DDP processes (``trainer=ddp_cpu``), its MFU against the machine's own
matmul peak, and nanoGPT's MFU estimate of the same model at the same speed beside it.

Usage::

    python -m transformers_lab.bench.throughput                  # 300 steps, 3 repeats
    python -m transformers_lab.bench.throughput --steps 100 --repeats 1 --out bench_out/throughput

Each run is ``tlab-train experiment=baby_gpt trainer.max_steps=<steps>`` in a process of its
own, as a user runs it; its ``perf/tokens_per_s`` and ``perf/mfu`` are the run's own means
(``run.callbacks.throughput``: every logged interval but the first, validation left out).
The two settings alternate, so drift in the machine's speed hits both. The peak is
measured first: the best rate of a float32 matmul of 2,048 x 2,048 on all the cores, the
rate the model's products could reach at most (each of two processes gets half of it).
nanoGPT's estimate is its ``estimate_mfu`` formula (``model.py``): 6 N + 12 L H Q T FLOPs a
token, N the parameters but the position table, T the context, at the same tokens a
second and the same peak.
"""

from __future__ import annotations

import argparse
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

MODULE = "transformers_lab.bench.throughput"
# each setting's overrides and processes: the peak of all the cores is shared among them
SETTINGS = {"1 process": (["trainer=cpu"], 1), "2 DDP processes": (["trainer=ddp_cpu"], 2)}


def matmul_peak(size: int = 2048, repeats: int = 10) -> float:
    """The best FLOP/s of a float32 matmul of ``size`` on this process's threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def nanogpt_flops_per_token(model: torch.nn.Module, context: int) -> float:
    """nanoGPT's ``estimate_mfu`` count: 6 N + 12 L H Q T, N without the position table."""
    n = model.num_params(non_embedding=True)
    layers, heads = len(model.blocks), model.blocks[0].mixer.n_head
    head_dim = model.blocks[0].mixer.head_dim
    return 6 * n + 12 * layers * heads * head_dim * context


def baby_gpt() -> tuple[torch.nn.Module, int]:
    """baby_gpt's model on meta, sized as on Tiny Shakespeare's characters (65 ids)."""
    from hydra.utils import instantiate

    from transformers_lab.config import compose_config

    cfg = compose_config("train", ["experiment=baby_gpt"], Path(tempfile.gettempdir()) / "plan")
    with torch.device("meta"):
        model = instantiate(cfg.model, vocab_size=65, block_size=cfg.data.block_size)
    return model, int(cfg.data.block_size)


def run(setting: list[str], steps: int, peak_tflops: float, out: Path) -> dict:
    """One ``tlab-train`` run; its record's metrics."""
    command = [
        sys.executable, "-m", "transformers_lab.train", "experiment=baby_gpt", *setting,
        f"trainer.max_steps={steps}", "trainer.enable_progress_bar=false", "logger=csv",
        "task.sample_tokens=0", f"callbacks.throughput.peak_tflops={peak_tflops}",
        f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(setting)} failed: {done.stderr[-2000:]}")
    return json.loads((out / "result.json").read_text())["metrics"]


def report(rows: dict[str, list[dict]], peak: float, ours: float, nanogpt: float) -> str:
    lines = [
        f"Peak: a float32 matmul of 2,048 on all cores, {peak / 1e9:.1f} GFLOP/s. FLOPs a "
        f"token of baby_gpt (context 64): ours {ours / 1e6:.3f}M (causal pairs), nanoGPT's "
        f"{nanogpt / 1e6:.3f}M (6 N + 12 L H Q T: every pair, LayerNorm weights in N).",
        "",
        "| setting | tokens/s (median) | MFU, ours | MFU, nanoGPT's estimate | each repeat |",
        "|---|---:|---:|---:|---|",
    ]
    base = None
    for name, metrics in rows.items():
        rates = [m["perf/tokens_per_s"] for m in metrics]
        rate = statistics.median(rates)
        base = base or rate
        mfu = statistics.median(m["perf/mfu"] for m in metrics)
        lines.append(
            f"| {name} | {rate:,.0f} ({rate / base:.2f}x) | {mfu:.1%} | "
            f"{rate * nanogpt / peak:.1%} | {', '.join(f'{r:,.0f}' for r in rates)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_out/throughput"))
    args = parser.parse_args(argv)
    peak = matmul_peak()
    model, context = baby_gpt()
    ours, nanogpt = model.flops_per_token(context), nanogpt_flops_per_token(model, context)
    rows: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name, (setting, processes) in SETTINGS.items():
                out = Path(scratch) / f"{repeat}-{processes}"
                rows[name].append(run(setting, args.steps, peak / processes / 1e12, out))
                rate = rows[name][-1]["perf/tokens_per_s"]
                print(f"{name}, repeat {repeat}: {rate:,.0f} tokens/s", flush=True)
    text = report(rows, peak, ours, nanogpt)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
