"""Forward+backward wall time and extra peak memory of every attention kernel against N.

Usage::

    python -m transformers_lab.bench.kernels --n 1024 2048 4096 --causal causal \\
        --kernels softmax fastmax_p2 --out bench_out/kernels
    python -m transformers_lab.bench.kernels --kernels softmax relu2 --config-dir my_conf

A kernel is any name the ``attention`` group takes (the user's own from ``--config-dir``),
a registered kernel, a class path or a kernel yaml (``attention/resolve.py``), or one of
the variants below (another path of an option, ``<option>_compiled``).

Every (variant, causal, N) is measured in a fresh worker process
(``python -m transformers_lab.bench.kernels --worker '<json spec>'``), so a crash, an
out-of-memory kill or a timeout costs one row, never the whole run. The worker:

1. builds the kernel, and q, k, v ~ randn (B, H, N, D) with ``requires_grad``;
2. runs one tiny fwd+bwd at N = 64 to load the libraries and start the thread pool (on
   cuda one at the timed N: Triton kernels compile and autotune for their shape);
3. measures the extra peak memory of ONE fwd+bwd at the real N:

   - cuda: ``max_memory_allocated`` minus ``memory_allocated`` before the pass;
   - cpu: the process starts with ``MALLOC_MMAP_THRESHOLD_=65536``, so freed large buffers
     go back to the OS and the resident set tracks the live tensors. The high-water mark
     ``VmHWM`` is reset by writing ``5`` to ``/proc/self/clear_refs``; the extra peak is
     ``VmHWM`` after the pass minus ``VmRSS`` before it. Where ``clear_refs`` does not work,
     ``ru_maxrss`` (the peak over the whole process life) stands in, as ``mem_method`` says;

4. on cpu, gives glibc back its usual habit of keeping freed memory for reuse (``mallopt``):
   mapping and unmapping every large buffer, as the setting of step 3 makes it do, page-faults
   fresh memory on every pass and slows allocation-heavy kernels by up to 2x;
5. runs one warm-up fwd+bwd, then times ``--repeats`` more and reports the median;
6. on cpu, runs one more fwd+bwd under ``torch.profiler`` and reports the time spent in
   matrix products (``matmul_ms``: the self time of ``MATMUL_OPS``): against a linear
   kernel's FLOP bound, how far its products alone are from it, at the shapes it uses,
   and what the rest of its work (feature maps, copies, Python) costs.

The backward starts from a gradient of ones held in memory, the gradient of
``out.sum()`` made dense as a model's loss hands it over (``dense_backward``); the extra
memory therefore includes it and the gradients of q, k and v (4 x B*H*N*D elements), the
same for every variant.

Outputs in ``--out``: ``kernels.csv``, ``kernels.md`` (the table and ratios to softmax) and
``kernels.png`` (time and memory against N, log-log).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import functools
import gc
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import get_class, instantiate
from torch import Tensor

from transformers_lab.attention import AttentionKernel
from transformers_lab.attention.backends import unavailable
from transformers_lab.attention.resolve import UnknownKernel, config_dirs, kernel_config
from transformers_lab.cli import fail
from transformers_lab.config import CONF_DIR, attention_configs
from transformers_lab.nn.parts import ShortConvolution

BASELINE = "softmax"  # the variant the others' time and memory are divided by
# Variants beyond the attention options: another code path of one option, for comparison.
PATH_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fastmax_p2_quadratic": ("fastmax_p2", {"impl": "quadratic"}),  # the N x N reference
    # q, k and v as a layer hands them over: views of one fused (B, N, 3 H D) projection
    "fastmax_p2_fused": ("fastmax_p2", {}),
    # the same, through the layer's short convolution of width 4 (attention.short_conv):
    # its cost is its time over fastmax_p2_fused's
    "fastmax_p2_short_conv": ("fastmax_p2", {"short_conv": 4}),
    # the delta-rule presets without their layer's convolution: the kernels alone, given
    # contiguous q, k and v as linear is (the presets' time is the layer's, convolution in)
    "deltanet_no_conv": ("deltanet", {"short_conv": 0}),
    "gated_deltanet_no_conv": ("gated_deltanet", {"short_conv": 0}),
}
OWN_PROCESS = "own process"  # the row's time: ``timing`` says how it was measured
PAIRED = "paired"  # ... in one process with the other variants, passes alternated
FUSED_VARIANTS = frozenset({"fastmax_p2_fused"})  # and every variant with a short_conv
# ... and ``<option>_compiled`` for every option with a ``compiled`` option (the linear
# kernels): its chunk steps through torch.compile, compiled in the warm-up pass (not
# timed). Run only when named: the default run leaves them out.
COMPILED = "_compiled"
# ... and the fused backends beside our loops, also only when named (``attention.backends``):
# ``<option>_fla`` and ``<option>_flex`` for every option whose kernel a fused kernel covers
# (its ``backend: fla`` / ``flex``), ``<option>_loop`` for our loop on any device (on CUDA
# the option itself, ``backend: auto``, takes the fused kernel), and fla's ops alone, fed
# what our kernel would feed them: ``<option>_fla_op`` (``bench.fla_kernels``), the
# reference our ``_fla`` is held to (goal: within 1.2x)
FLA, FLEX, LOOP, FLA_OP = "_fla", "_flex", "_loop", "_fla_op"
FLA_OPS: dict[str, dict[str, Any]] = {
    name + FLA_OP: {"_target_": f"transformers_lab.bench.fla_kernels.{cls}", "_partial_": True}
    for name, cls in (("linear", "FlaLinearAttention"), ("based", "FlaBasedAttention"),
                      ("fastmax_p1", "FlaFastmaxP1"), ("fastmax_p2", "FlaFastmaxP2"))
}  # fmt: skip
GPU_ONLY = (FLA, FLEX, FLA_OP)  # suffixes of the variants that need --device cuda


def variants(dirs: Sequence[Path] = (CONF_DIR,)) -> dict[str, dict[str, Any]]:
    """Variant name -> kernel config (``_target_`` and options): every option of the
    attention group in ``dirs`` (``conf/`` and the user's config dirs; options that compose
    to the same config count once, under the last name: fastmax is fastmax_p2), softmax
    first, then ``PATH_VARIANTS``, then the compiled variants."""
    return composed_variants(tuple(dirs))


@functools.cache  # composing every option takes seconds: once a process, whatever the call
def composed_variants(dirs: tuple[Path, ...]) -> dict[str, dict[str, Any]]:
    options = attention_configs(dirs)
    unique = {json.dumps(c, sort_keys=True): name for name, c in options.items()}
    names = sorted(unique.values(), key=lambda n: (n != BASELINE, n))  # the baseline first
    named = {name: options[name] for name in names}
    found = dict(named)
    for name, (base, extra) in PATH_VARIANTS.items():
        found[name] = {**options[base], **extra}
    return {**found, **compiled_variants(named), **fla_variants(named)}


def compiled_variants(options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``<option>_compiled`` -> its config with ``compiled: true``, for every option of
    ``options`` (name -> config) that has a ``compiled`` option."""
    return {
        name + COMPILED: {**c, "compiled": True} for name, c in options.items() if "compiled" in c
    }


def fla_variants(options: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``<option>_<backend>`` -> its config with that ``backend`` (``loop`` and each fused
    kernel its class lists in ``fused_backends``), for every option of ``options``; and
    fla's ops alone (``FLA_OPS``)."""
    found = {}
    for name, c in options.items():
        if "backend" not in c:  # no fused kernel to name (and no class to import for it)
            continue
        covers = getattr(get_class(c["_target_"]), "fused_backends", ())
        for backend in ("loop", *covers) if covers else ():
            found[f"{name}_{backend}"] = {**c, "backend": backend}
    return {**found, **FLA_OPS}


def default_variants(dirs: tuple[Path, ...] = (CONF_DIR,)) -> list[str]:
    """What a run without ``--kernels`` measures: every variant but the compiled ones
    (each compiles for every N, 10-20 s apiece) and the backends' (a GPU's; our loop is
    the option itself on a CPU)."""
    return [name for name in variants(dirs) if not name.endswith((COMPILED, LOOP, *GPU_ONLY))]


QUADRATIC_VARIANTS = frozenset({"additive", "fastmax_p2_quadratic"})

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
COLUMNS = (
    "variant",
    "causal",
    "n",
    "batch",
    "heads",
    "head_dim",
    "dtype",
    "device",
    "time_ms",
    "peak_mib",
    "state_numbers",
    "gflop",
    "matmul_ms",
    "status",
    "mem_method",
    "timing",
)
CAUSAL_MODES: dict[str, tuple[bool, ...]] = {
    "both": (True, False),
    "causal": (True,),
    "noncausal": (False,),
}
MODULE = "transformers_lab.bench.kernels"  # what a worker runs with ``python -m``
WARMUP_N = 64
RATE_SIZE = 2048  # the square matrices of the matmul rate
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
PROJECT_ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20

Row = dict[str, Any]


@dataclass(frozen=True)
class Spec:
    """One measurement: a variant at one sequence length and causality."""

    variant: str
    causal: bool
    n: int
    batch: int = 1
    heads: int = 4
    head_dim: int = 32
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    config: dict[str, Any] = field(default_factory=dict)  # the kernel's; {}: the variant's

    @property
    def kernel_config(self) -> dict[str, Any]:
        """What the kernel is built from: the config given, else the built-in variant's."""
        return self.config or variants()[self.variant]

    def row(
        self,
        status: str = "ok",
        time_ms: float | None = None,
        peak_mib: float | None = None,
        mem_method: str = "",
        matmul_ms: float | None = None,
    ) -> Row:
        """The result row of this measurement, in ``COLUMNS`` order."""
        fields = asdict(self)
        row = {name: fields.get(name) for name in COLUMNS}
        row.update(
            time_ms=time_ms,
            peak_mib=peak_mib,
            status=status,
            mem_method=mem_method,
            matmul_ms=matmul_ms,
            timing=OWN_PROCESS if time_ms is not None else "",
        )
        config = json.dumps(self.kernel_config, sort_keys=True)
        row["state_numbers"] = state_numbers(config, self.n, self.heads, self.head_dim)
        flops = matmul_flops(config, self.n, self.causal, self.heads, self.head_dim)
        row["gflop"] = None if flops is None else self.batch * flops / 1e9
        return row


# --------------------------------------------------------------------------------------
# The measurement itself (runs inside a worker process)
# --------------------------------------------------------------------------------------


@functools.cache
def state_numbers(config: str, n: int, heads: int, head_dim: int) -> int:
    """Numbers a decoder keeps per sequence after ``n`` tokens with the kernel of this
    config (JSON; its ``state_size``): a KV cache grows with n, a linear state does not."""
    kernel = instantiate(json.loads(config))(head_dim=head_dim, num_heads=heads)
    return kernel.state_size(n)


@functools.cache
def matmul_flops(config: str, n: int, causal: bool, heads: int, head_dim: int) -> int | None:
    """The matrix-product FLOPs of one fwd+bwd of a linear kernel (its ``matmul_flops``),
    one sequence; None for the others."""
    kernel = instantiate(json.loads(config))(head_dim=head_dim, num_heads=heads)
    counter = getattr(kernel, "matmul_flops", None)
    return None if counter is None or not getattr(kernel, "linear", False) else counter(n, causal)


def matmul_rate(device: str = "cpu", dtype: str = "float32", size: int = 2048) -> float:
    """This machine's matmul rate, GFLOP/s: the median of 5 products of two square
    ``size`` x ``size`` matrices, after one warm-up, on the default thread count."""
    a, b = (torch.randn(size, size, device=device, dtype=DTYPES[dtype]) for _ in range(2))
    a @ b
    seconds = [timed(lambda: a @ b, device) for _ in range(5)]
    return 2 * size**3 / statistics.median(seconds) / 1e9


def variant_configs(
    names: Iterable[str], dirs: tuple[Path, ...] = (CONF_DIR,)
) -> dict[str, dict[str, Any]]:
    """Each name -> its kernel config: a variant (an option of the attention group in
    ``dirs``, another path of one, a compiled one), else any other target of
    ``attention.resolve`` (a yaml, a registered kernel, a class path). A ValueError listing
    the valid variants if one is unknown."""
    known = variants(dirs)
    configs, unknown = {}, []
    for name in names:
        try:
            configs[name] = known[name] if name in known else kernel_config(name, dirs)
        except UnknownKernel:
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"unknown variant(s) {', '.join(map(repr, unknown))}; valid variants are: "
            f"{', '.join(known)}; or a kernel yaml, a class as package.module.Class, and your "
            "own attention options with --config-dir DIR"
        )
    return configs


def build_variant(spec: Spec) -> AttentionKernel:
    """The kernel of ``spec.variant``, on the spec's device and dtype."""
    config = dict(spec.kernel_config)
    if "max_len" in config:  # a positional kernel (cosformer): positions up to N
        config["max_len"] = max(config["max_len"], spec.n)
    kernel = instantiate(config)(head_dim=spec.head_dim, num_heads=spec.heads)
    return kernel.to(device=spec.device, dtype=DTYPES[spec.dtype])


def make_inputs(spec: Spec, n: int, qk_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k ~ randn (B, H, n, qk_dim) and v ~ randn (B, H, n, D) that require grad."""
    dtype = DTYPES[spec.dtype]
    return tuple(  # type: ignore[return-value]
        torch.randn(
            (spec.batch, spec.heads, n, d), device=spec.device, dtype=dtype, requires_grad=True
        )
        for d in (qk_dim, qk_dim, spec.head_dim)
    )


def fused_widths(kernel: AttentionKernel, spec: Spec) -> list[int]:
    """The widths of q, k and v in the layer's fused projection."""
    return [spec.heads * d for d in (kernel.qk_dim, kernel.qk_dim, spec.head_dim)]


def make_gates(kernel: AttentionKernel, spec: Spec, n: int) -> dict[str, Tensor]:
    """The kernel's gate inputs (a gated kernel's decay, the delta rule's beta) as its layer
    would pass them, drawn and requiring grad; none for the other kernels."""
    gates = kernel.sample_gates(spec.batch, n, DTYPES[spec.dtype])
    return {name: g.to(spec.device).requires_grad_() for name, g in gates.items()}


def dense_backward(out: Tensor) -> None:
    """Backward from a gradient of ones held in memory, as a model's loss hands a kernel a
    dense gradient: ``out.sum()``'s is one number broadcast (stride 0), which sends a
    batched product's backward through a copy of each matrix (ATen's strided fallback)."""
    out.backward(torch.ones_like(out))


def fwd_bwd(
    kernel: AttentionKernel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    gates: dict[str, Tensor] | None = None,
) -> None:
    """One forward and backward pass; gradients start from None so every pass allocates."""
    gates = gates or {}
    for t in (q, k, v, *gates.values()):
        t.grad = None
    kernel.zero_grad(set_to_none=True)
    out = kernel(q, k, v, causal=causal, **gates)
    dense_backward(out)


def fwd_bwd_fused(
    kernel: AttentionKernel,
    conv: Any,
    x: Tensor,
    spec: Spec,
    gates: dict[str, Tensor] | None = None,
) -> None:
    """``fwd_bwd`` on q, k and v as a layer hands them over: x (B, N, H (2 qk_dim + D)),
    the fused projection, through the layer's short convolution (``conv``; None: none),
    split into per-head views."""
    x.grad = None
    kernel.zero_grad(set_to_none=True)
    b, n, _ = x.shape
    mixed = x
    if conv is not None:
        conv.zero_grad(set_to_none=True)
        mixed, _ = conv(x)
    q, k, v = (
        t.view(b, n, spec.heads, -1).transpose(1, 2)
        for t in mixed.split(fused_widths(kernel, spec), dim=-1)
    )
    gates = gates or {}
    for t in gates.values():
        t.grad = None
    if "beta" in kernel.gate_inputs:  # the delta rule takes unit keys, as its layer gives
        k = F.normalize(k, dim=-1)
    out = kernel(q, k, v, causal=spec.causal, **gates)
    dense_backward(out)


def synchronize(device: str) -> None:
    """Wait for queued device work, so that wall time covers it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(run: Callable[[], None], device: str) -> float:
    """Wall seconds of ``run()``."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def proc_status_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (e.g. VmRSS, VmHWM), or None where unreadable."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, flags=re.MULTILINE)
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    hwm, rss = proc_status_kib("VmHWM"), proc_status_kib("VmRSS")
    # After a reset the high-water mark equals the resident set (give it 1 MiB of slack).
    return hwm is not None and rss is not None and hwm <= rss + 1024


def peak_cpu(run: Callable[[], None]) -> tuple[float, str]:
    """Extra peak resident memory (bytes) of ``run()``, and the method used."""
    gc.collect()
    if reset_peak_rss():
        before = proc_status_kib("VmRSS") or 0
        run()
        after = proc_status_kib("VmHWM") or 0
        method = "vmhwm"
    else:  # ru_maxrss is the peak over the process life: an upper bound here
        before = proc_status_kib("VmRSS") or 0
        run()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        method = "ru_maxrss (clear_refs unavailable)"
    return max(0, after - before) * 1024.0, method


def peak_cuda(run: Callable[[], None], device: str) -> tuple[float, str]:
    """Extra peak allocated CUDA memory (bytes) of ``run()``, and the method used."""
    gc.collect()
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - before), "cuda_max_allocated"


def reuse_freed_memory() -> bool:
    """Undo ``MALLOC_MMAP_THRESHOLD_`` for the timing: glibc keeps freed memory for reuse.

    Sets the thresholds that glibc's own adaptive ones reach after freeing large buffers
    (mmap above 32 MiB, trim above 64 MiB). False where there is no glibc ``mallopt``.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mmap_ok = mallopt(M_MMAP_THRESHOLD, 32 * MIB)
    trim_ok = mallopt(M_TRIM_THRESHOLD, 64 * MIB)
    return bool(mmap_ok and trim_ok)


def prepare(spec: Spec) -> Callable[[], None]:
    """One fwd+bwd pass of ``spec``'s kernel at ``spec.n``, ready to call: the kernel
    built, the libraries loaded by a tiny pass, a compiled kernel compiled for this N."""
    torch.manual_seed(0)
    kernel = build_variant(spec)
    fused = bool(kernel.parts.short_conv) or spec.variant in FUSED_VARIANTS
    conv = None
    if kernel.parts.short_conv:
        conv = ShortConvolution(sum(fused_widths(kernel, spec)), kernel.parts.short_conv)
        conv = conv.to(device=spec.device, dtype=DTYPES[spec.dtype])

    def run_at(n: int) -> Callable[[], None]:
        if fused:  # q, k, v as views of the layer's fused projection
            x = torch.cat(
                [
                    t.transpose(1, 2).reshape(spec.batch, n, -1)
                    for t in make_inputs(spec, n, kernel.qk_dim)
                ],
                dim=-1,
            ).detach()
            x.requires_grad_()  # (B, N, H (2 qk_dim + D))
            gates = make_gates(kernel, spec, n)
            return lambda: fwd_bwd_fused(kernel, conv, x, spec, gates)
        q, k, v = make_inputs(spec, n, kernel.qk_dim)
        if "beta" in kernel.gate_inputs:  # the delta rule takes unit keys, as its layer gives
            k = F.normalize(k.detach(), dim=-1).requires_grad_()
        gates = make_gates(kernel, spec, n)
        return lambda: fwd_bwd(kernel, q, k, v, spec.causal, gates)

    if spec.device.startswith("cuda"):  # warmed up at the timed N: a Triton kernel (fla's,
        run = run_at(spec.n)  # FlexAttention's) compiles and autotunes for its shape, which
        run()  # then is neither the peak's nor the time's
        return run
    run_at(min(WARMUP_N, spec.n))()  # load libraries, start threads; inputs freed after
    run = run_at(spec.n)
    if getattr(kernel, "compiled", False):
        run()  # compiled for this N before the peak: the compiler's memory is not the kernel's
    return run


def measure_once(spec: Spec) -> Row:
    """Measure ``spec`` in this process: extra peak memory of one pass, then median time.

    On CPU the memory figure is only meaningful in a fresh process (see the module doc).
    """
    run = prepare(spec)
    if spec.device.startswith("cuda"):
        peak, method = peak_cuda(run, spec.device)
    else:
        peak, method = peak_cpu(run)
        reuse_freed_memory()
    run()  # warm-up of the timing, with the allocator as it will be
    seconds = [timed(run, spec.device) for _ in range(spec.repeats)]
    return spec.row(
        time_ms=1e3 * statistics.median(seconds),
        peak_mib=peak / MIB,
        mem_method=method,
        matmul_ms=None if spec.device.startswith("cuda") else matmul_time_ms(run),
    )


def paired_times(specs: Sequence[Spec]) -> dict[str, float]:
    """Variant -> median milliseconds of its fwd+bwd, all of ``specs`` (one causal mode and
    N) timed in this process with their passes alternated, each repeat one pass of every
    variant: what the process's and the machine's speed does to one does to the others."""
    reuse_freed_memory()
    runs = {spec.variant: prepare(spec) for spec in specs}
    for run in runs.values():
        run()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(max(spec.repeats for spec in specs)):
        for name, run in runs.items():
            seconds[name].append(timed(run, specs[0].device))
    return {name: 1e3 * statistics.median(times) for name, times in seconds.items()}


# the ATen operators of matrix products, as the CPU profiler names them (Inductor's
# compiled steps call the same ones for theirs)
MATMUL_OPS = frozenset(
    {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::_mm"}
)


def matmul_time_ms(run: Callable[[], None]) -> float:
    """Milliseconds that one ``run()`` spends in matrix products (CPU): the self time of
    ``MATMUL_OPS`` under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    micros = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATMUL_OPS)
    return micros / 1e3


def worker_main(spec_json: str) -> int:
    """Entry point of a worker process: measure one spec and print its row as JSON; given
    a list of specs, time them paired (``paired_times``) and print the times as JSON."""
    given = json.loads(spec_json)
    if isinstance(given, list):
        try:
            result: Any = paired_times([Spec(**s) for s in given])
        except Exception as exc:  # reported, and the caller keeps the unpaired times
            result = {"error": error_status(f"{type(exc).__name__}: {exc}")}
        print(json.dumps(result), flush=True)
        return 0
    print(json.dumps(measure_or_error(Spec(**given))), flush=True)
    return 0


def measure_or_error(spec: Spec) -> Row:
    """``measure_once(spec)``, or an error row saying why it failed (never a crash)."""
    try:
        return measure_once(spec)
    except Exception as exc:  # any failure becomes an error row
        return spec.row(status=error_status(f"{type(exc).__name__}: {exc}"))


def error_status(message: str) -> str:
    """``error: <message>`` on one line, short enough for a table cell."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines else "unknown error"
    return f"error: {text[:200]}"


# --------------------------------------------------------------------------------------
# The parent: one worker process per measurement
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------


def is_ok(row: Row) -> bool:
    return row["status"] == "ok"


def fmt(x: float | None) -> str:
    """A number for a table cell: a few significant digits, '–' when missing."""
    if x is None or not math.isfinite(x):
        return "–"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3f}"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """All rows, ``COLUMNS`` in order; missing numbers are empty cells."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row[k] is None else row[k] for k in COLUMNS})


def markdown_table(header: Sequence[str], body: Iterable[Sequence[Any]]) -> list[str]:
    """Lines of a markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in cells) + " |" for cells in body]
    return lines


def bound_ms(row: Row, rate: float | None) -> float | None:
    """The time of a row's matmul FLOPs at ``rate`` GFLOP/s: a floor on its time."""
    if rate is None or row.get("gflop") in (None, ""):
        return None
    return 1e3 * float(row["gflop"]) / rate


def results_table(rows: Sequence[Row], rate: float | None = None) -> list[str]:
    """The main table: one line per measurement; for the linear kernels, the time their
    matmul FLOPs take at ``rate`` (the bound) and their time over it; for every kernel
    measured on CPU, the time in matrix products, and that over the bound."""
    body = (
        (
            r["variant"],
            "causal" if r["causal"] else "noncausal",
            r["n"],
            fmt(r["time_ms"]),
            fmt(r["peak_mib"]),
            f"{r['state_numbers']:,}" if r.get("state_numbers") is not None else "",
            fmt(bound_ms(r, rate)),
            fmt(ratio(r["time_ms"], bound_ms(r, rate))),
            fmt(r.get("matmul_ms")),
            fmt(ratio(r.get("matmul_ms"), bound_ms(r, rate))),
            r["status"],
        )
        for r in rows
    )
    header = ("variant", "mode", "N", "time (ms)", "extra peak (MiB)", "decode state",
              "FLOP bound (ms)", "÷ bound", "matmuls (ms)", "matmuls ÷ bound",
              "status")  # fmt: skip
    return markdown_table(header, body)


def ratio_table(rows: Sequence[Row], causal: bool) -> list[str]:
    """Time and memory relative to softmax at each N, and memory growth from the previous N."""
    ok = {(r["variant"], r["n"]): r for r in rows if r["causal"] == causal and is_ok(r)}
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["causal"] == causal))
    ns = sorted({r["n"] for r in rows if r["causal"] == causal})
    body = []
    for n in ns:
        base = ok.get((BASELINE, n))
        for variant in variants:
            row = ok.get((variant, n))
            if row is None:
                continue
            previous = [m for m in ns if m < n and (variant, m) in ok]
            prev = ok[(variant, previous[-1])] if previous else None
            body.append(
                (
                    n,
                    variant,
                    fmt(ratio(row["time_ms"], base and base["time_ms"])),
                    fmt(ratio(row["peak_mib"], base and base["peak_mib"])),
                    fmt(ratio(row["peak_mib"], prev and prev["peak_mib"])),
                )
            )
    header = ("N", "variant", "time ÷ softmax", "peak ÷ softmax", "peak ÷ peak at previous N")
    return markdown_table(header, body)


def timing_note(rows: Sequence[Row]) -> str:
    """How the rows' times were taken, for the report's first line."""
    timings = {r["timing"] for r in rows if is_ok(r)}
    if timings == {PAIRED}:
        return "the variants of each mode and N timed in one process, their passes alternated"
    if PAIRED in timings:
        return "timed as the csv's `timing` says (paired: with the other variants in one process)"
    return "each variant in its own process"


def markdown_report(rows: Sequence[Row], rate: float | None = None) -> str:
    """The whole ``kernels.md``: set-up, results, and a ratio table per causal mode;
    ``rate``: the machine's matmul GFLOP/s, for the linear kernels' FLOP bound."""
    if not rows:
        return "# Attention kernels: forward + backward\n\nNo measurements.\n"
    first = rows[0]
    methods = sorted({r["mem_method"] for r in rows if r["mem_method"]}) or ["–"]
    lines = [
        "# Attention kernels: forward + backward",
        "",
        f"batch={first['batch']}, heads={first['heads']}, head_dim={first['head_dim']}, "
        f"dtype={first['dtype']}, device={first['device']}; time is the median over the "
        f"timed repeats, {timing_note(rows)}; extra peak memory by {', '.join(methods)}.",
        "",
        *(
            [
                f"FLOP bound: a linear kernel's matmul FLOPs (its `matmul_flops`) at this "
                f"machine's measured matmul rate, {rate:.0f} GFLOP/s (square {RATE_SIZE} "
                f"products, {torch.get_num_threads()} threads). Matmuls: the time one pass "
                "spends in matrix products (`torch.profiler`, CPU), at the shapes the kernel "
                "uses; the rest of its time is its other work.",
                "",
            ]
            if rate
            else []
        ),
        *results_table(rows, rate),
    ]
    for causal in (True, False):
        if any(r["causal"] == causal for r in rows):
            mode = "causal" if causal else "non-causal"
            lines += ["", f"## Ratios, {mode}", "", *ratio_table(rows, causal)]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: Path) -> None:
    """Time and extra peak memory against N, log-log; solid causal, dashed non-causal."""
    from transformers_lab.analysis.plots import plot_kernel_benchmark

    plot_kernel_benchmark([r for r in rows if is_ok(r)]).savefig(path, dpi=120, bbox_inches="tight")


def write_reports(
    rows: Sequence[Row], out_dir: Path | str, rate: float | None = None
) -> dict[str, Path]:
    """Write ``kernels.csv``, ``kernels.md`` and ``kernels.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: out_dir / f"kernels.{ext}" for ext in ("csv", "md", "png")}
    write_csv(rows, paths["csv"])
    paths["md"].write_text(markdown_report(rows, rate))
    plot(rows, paths["png"])
    return paths


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


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


if __name__ == "__main__":
    sys.exit(main())
