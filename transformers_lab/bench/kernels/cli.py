"""The command line: its arguments and their checks, and ``main``: a run and its reports,
or, given ``--worker``, one measurement's own process."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from transformers_lab.attention.backends import unavailable
from transformers_lab.attention.resolve import config_dirs
from transformers_lab.bench.kernels.report import write_reports
from transformers_lab.bench.kernels.runner import run_bench
from transformers_lab.bench.kernels.specs import (
    CAUSAL_MODES,
    DTYPES,
    FLA,
    FLA_OP,
    GPU_ONLY,
    QUADRATIC_VARIANTS,
    default_variants,
    variant_configs,
    variants,
)
from transformers_lab.bench.kernels.worker import RATE_SIZE, matmul_rate, worker_main
from transformers_lab.cli import fail


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m transformers_lab.bench.kernels",
        description="Forward+backward time and extra peak memory of attention kernels vs N.",
    )
    parser.add_argument(
        "--n",
        type=positive_int,
        nargs="+",
        default=[512, 1024, 2048, 4096, 8192, 16384],
        help="sequence lengths",
    )
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=positive_int, default=32)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--causal", choices=list(CAUSAL_MODES), default="both")
    parser.add_argument(
        "--kernels",
        nargs="+",
        metavar="VARIANT",
        help=f"variants to run (default: {', '.join(default_variants())}, and the options of "
        f"each --config-dir; also: "
        f"{', '.join(sorted(set(variants()) - set(default_variants())))}; or any attention "
        "option, registered kernel, kernel yaml or package.module.Class)",
    )
    parser.add_argument(
        "--config-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a config dir of yours (as on hydra.searchpath): its attention/ options are "
        "variants too",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed passes after the warm-up; the median is reported",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="measure each variant this many times, in fresh workers, the rounds "
        "interleaved, and report the round of median time: ratios between variants that "
        "one process's speed on a shared machine does not sway",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="time the variants of each mode and N once more in one process, their passes "
        "alternated, and report those times: the ratios to read where variants differ by "
        "a few percent (memory stays each variant's own worker's)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench_out/kernels"), help="output directory"
    )
    parser.add_argument(
        "--quadratic-max-n",
        type=positive_int,
        default=4096,
        help=f"skip {', '.join(sorted(QUADRATIC_VARIANTS))} above this N",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds allowed per measurement"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="measure every variant in this one process, N by N (cuda only: its allocator "
        "gives each pass's own peak; no process start or CUDA set-up per measurement); "
        "nothing is interrupted: a variant whose passes at one N took over --timeout is "
        "not measured at the longer ones",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments; unknown variants exit with the list of valid ones."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        dirs = tuple(config_dirs(args.config_dir))
        args.kernels = list(dict.fromkeys(args.kernels or default_variants(dirs)))
        args.configs = variant_configs(args.kernels, dirs)
    except ValueError as exc:
        fail(str(exc))  # one line: the kernel named and the valid ones
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    gpu = [name for name in args.kernels if name.endswith(GPU_ONLY)]
    if gpu and args.device != "cuda":
        fail(f"{', '.join(gpu)}: the fused backends are timed on --device cuda; drop them here")
    fla = [name for name in gpu if name.endswith((FLA, FLA_OP))]
    if fla and (why := unavailable("fla")):
        fail(f"{', '.join(fla)}: fla's kernels cannot run here: {why}")
    if args.in_process and args.device != "cuda":
        fail(
            "--in-process measures on --device cuda only (a CPU process's resident memory "
            "keeps what earlier passes freed); drop it to measure each variant in its own "
            "process"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"] and len(argv) == 2:  # a measurement's own process (call_worker)
        return worker_main(argv[1])  # its spec carries its config: no parser, no composing
    args = parse_args(argv)
    rate = matmul_rate(args.device, args.dtype, RATE_SIZE)
    print(f"matmul rate: {rate:.0f} GFLOP/s", file=sys.stderr, flush=True)
    rows = run_bench(args)
    paths = write_reports(rows, args.out, rate)
    print(paths["md"].read_text())
    for path in paths.values():
        print(f"wrote {path}")
    return 0
