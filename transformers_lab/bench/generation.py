"""Time per generated token against context length, for GPT with each kernel's cache.

Usage::

    python -m transformers_lab.bench.generation --context 256 4096 --kernels softmax fastmax
    python -m transformers_lab.bench.generation --kernels softmax relu2 --config-dir my_conf

For every (kernel, context) a GPT with untrained weights encodes a random prompt of
``context`` tokens once (not timed), then generates ``--new-tokens`` tokens greedily, one
cached step each; the figure is the median wall time of a step. The kernels that form
scores keep a KV cache that grows with the context; the linear ones (fastmax, linear,
based, performer, cosformer) keep a fixed-size state. Every option of the attention
group by default (the user's own with ``--config-dir``), as configured there (a positional
kernel's ``max_len`` is the longest context); a kernel is named as for ``bench.kernels``.
Writes ``generation.csv`` and ``generation.md`` to ``--out``: time per token, the
cache's MiB and its ``state_size`` (numbers per sequence, all layers).

With ``--trained-at N`` the model's context is N (RoPE positions, which go on) and every
longer context is decoded past it on the decoding state (``GPT.forward_on_state``): a
constant state carries on, a KV cache slides a window of N tokens, so neither the time
per token nor the cache grows with the context; a kernel that cannot go past N
(cosFormer's positions) is said and left out::

    python -m transformers_lab.bench.generation --trained-at 64 --context 64 256 1024 4096
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from hydra.utils import instantiate

from transformers_lab.attention.resolve import config_dirs
from transformers_lab.bench.kernels import PATH_VARIANTS, default_variants, variant_configs
from transformers_lab.cli import fail
from transformers_lab.models import GPT


def cache_mib(cache: object) -> float:
    """Size of every tensor in a (nested) cache, in MiB."""
    if isinstance(cache, torch.Tensor):
        return cache.numel() * cache.element_size() / 2**20
    if isinstance(cache, list | tuple):
        return sum(cache_mib(c) for c in cache)
    return 0.0


@torch.no_grad()
def time_per_token(
    model: GPT, context: int, new_tokens: int, device: str, past_context: bool = False
) -> tuple[float, float]:
    """Median seconds per cached step after a ``context``-token prompt, and the cache size;
    ``past_context``: read and step on the decoding state past ``block_size``."""
    step = model.forward_on_state if past_context else model.forward_cached
    prompt = torch.randint(0, model.vocab_size, (1, context), device=device)
    logits, cache = step(prompt)
    next_id = logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for t in range(new_tokens):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits, cache = step(next_id, cache, offset=context + t)
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:] or times), cache_mib(cache)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m transformers_lab.bench.generation", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument(
        "--kernels", nargs="+", help="default: every attention option, the user's included"
    )
    parser.add_argument(
        "--config-dir", action="append", default=[], metavar="DIR", help="a config dir of yours"
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--trained-at",
        type=int,
        metavar="N",
        help="the model's context (RoPE): longer contexts are decoded past it on its state",
    )
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench_out/generation"))
    args = parser.parse_args(argv)
    try:
        dirs = tuple(config_dirs(args.config_dir))
        names = args.kernels or [n for n in default_variants(dirs) if n not in PATH_VARIANTS]
        configs = variant_configs(names, dirs)
    except ValueError as exc:
        fail(str(exc))  # one line: the kernel named and the valid ones

    if args.trained_at is not None and args.trained_at < 1:
        fail(f"--trained-at must be a context of at least 1 token, got {args.trained_at}")
    rows = []
    past = args.trained_at is not None
    block_size = args.trained_at if past else max(args.context) + args.new_tokens
    for kernel, config in configs.items():
        torch.manual_seed(0)
        if "max_len" in config:  # a positional kernel (cosformer): positions up to the block
            config = {**config, "max_len": max(config["max_len"], block_size)}
        factory = instantiate(config)
        model = (
            GPT(
                args.vocab,
                block_size,
                n_layer=args.n_layer,
                n_head=args.n_head,
                d_model=args.d_model,
                pos_encoding="rope" if past else "sinusoidal",
                attention=factory,
            )
            .to(args.device)
            .eval()
        )
        if past and (limit := model.decode_limit()):
            print(
                f"{kernel}: left out, it cannot decode past its context ({limit})", file=sys.stderr
            )
            continue
        for context in args.context:
            seconds, mib = time_per_token(model, context, args.new_tokens, args.device, past)
            rows.append(
                {
                    "kernel": kernel,
                    "context": context,
                    "ms_per_token": 1e3 * seconds,
                    "cache_mib": mib,
                    # past the context a KV cache holds the window, not every token
                    "state_size": model.state_size(
                        min(context + args.new_tokens, block_size)
                        if past
                        else context + args.new_tokens
                    ),
                }
            )
            print(
                f"{kernel:<10} context={context:<6} {1e3 * seconds:8.3f} ms/token "
                f"cache {mib:8.2f} MiB",
                file=sys.stderr,
                flush=True,
            )

    if not rows:
        fail("no kernel left to time: each of them was left out (see above)")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "generation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    trained = f", trained at {args.trained_at} (RoPE), decoded past it" if past else ""
    lines = [
        f"# Cached generation, GPT {args.n_layer} layers x {args.n_head} heads x "
        f"{args.d_model}, batch 1, {args.device}{trained}",
        "",
        "| kernel | context | ms / token | vs first context | cache (MiB) | state_size |",
        "|---|---|---|---|---|---|",
    ]
    first = {}
    for row in rows:
        base = first.setdefault(row["kernel"], row["ms_per_token"])
        lines.append(
            f"| {row['kernel']} | {row['context']} | {row['ms_per_token']:.3f} | "
            f"{row['ms_per_token'] / base:.2f}x | {row['cache_mib']:.2f} | "
            f"{row['state_size']:,} |"
        )
    (args.out / "generation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
