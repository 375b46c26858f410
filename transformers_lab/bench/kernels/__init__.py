"""Forward+backward wall time and extra peak memory of every attention kernel against N.

Usage::

    python -m transformers_lab.bench.kernels --n 1024 2048 4096 --causal causal \\
        --kernels softmax fastmax_p2 --out bench_out/kernels
    python -m transformers_lab.bench.kernels --kernels softmax relu2 --config-dir my_conf

A kernel is any name the ``attention`` group takes (the user's own from ``--config-dir``),
a registered kernel, a class path or a kernel yaml (``attention/resolve.py``), or one of
the variants of ``specs`` (another path of an option, ``<option>_compiled``).

Every (variant, causal, N) is measured in a fresh worker process
(``python -m transformers_lab.bench.kernels --worker '<json spec>'``), so a crash, an
out-of-memory kill or a timeout costs one row, never the whole run; ``worker`` says how
one measurement goes.

Outputs in ``--out``: ``kernels.csv``, ``kernels.md`` (the table and ratios to softmax) and
``kernels.png`` (time and memory against N, log-log).

The modules: ``specs`` (the variants and one measurement's ``Spec``), ``worker`` (one
measurement, in its own process), ``runner`` (the parent: every measurement, each in a
worker), ``report`` (the csv, markdown and plot) and ``cli`` (the command line).
"""

from transformers_lab.bench.kernels.cli import build_parser, main, parse_args
from transformers_lab.bench.kernels.runner import measure_here, run_bench, too_slow, worker_env
from transformers_lab.bench.kernels.specs import (
    COMPILED,
    FLA,
    FLA_OP,
    FLEX,
    GPU_ONLY,
    LOOP,
    PATH_VARIANTS,
    TRITON,
    Spec,
    compiled_variants,
    default_variants,
    variant_configs,
    variants,
)
from transformers_lab.bench.kernels.worker import (
    MIB,
    error_status,
    proc_status_kib,
    reset_peak_rss,
    reuse_freed_memory,
)
from transformers_lab.config import CONF_DIR

__all__ = [
    "COMPILED",
    "CONF_DIR",
    "FLA",
    "FLA_OP",
    "TRITON",
    "FLEX",
    "GPU_ONLY",
    "LOOP",
    "MIB",
    "PATH_VARIANTS",
    "Spec",
    "build_parser",
    "compiled_variants",
    "default_variants",
    "error_status",
    "main",
    "measure_here",
    "parse_args",
    "proc_status_kib",
    "reset_peak_rss",
    "reuse_freed_memory",
    "run_bench",
    "too_slow",
    "variant_configs",
    "variants",
    "worker_env",
]
