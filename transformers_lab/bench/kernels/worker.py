"""One measurement, in its own process: build a variant's pass, measure its extra peak
memory, time it, and print the row (``worker_main``, run as
``python -m transformers_lab.bench.kernels --worker '<json spec>'``). The worker:

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
"""

from __future__ import annotations

import gc
import json
import re
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import Tensor

from transformers_lab.attention import AttentionKernel, call_with_heads
from transformers_lab.bench.kernels.specs import DTYPES, FUSED_VARIANTS, Row, Spec
from transformers_lab.nn.parts import LayerParts, ShortConvolution, split_layer_parts
from transformers_lab.run.memory import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, set_malloc

WARMUP_N = 64
RATE_SIZE = 2048  # the square matrices of the matmul rate
MIB = 2**20


def matmul_rate(device: str = "cpu", dtype: str = "float32", size: int = 2048) -> float:
    """This machine's matmul rate, GFLOP/s: the median of 5 products of two square
    ``size`` x ``size`` matrices, after one warm-up, on the default thread count."""
    a, b = (torch.randn(size, size, device=device, dtype=DTYPES[dtype]) for _ in range(2))
    a @ b
    seconds = [timed(lambda: a @ b, device) for _ in range(5)]
    return 2 * size**3 / statistics.median(seconds) / 1e9


def build_variant(spec: Spec) -> tuple[AttentionKernel, LayerParts]:
    """The kernel of ``spec.variant``, on the spec's device and dtype, and the layer's
    switches its config carries (a short convolution is timed with the kernel)."""
    config = dict(spec.kernel_config)
    if "max_len" in config:  # a positional kernel (cosformer): positions up to N
        config["max_len"] = max(config["max_len"], spec.n)
    factory, parts = split_layer_parts(instantiate(config))
    kernel = call_with_heads(factory, spec.heads, head_dim=spec.head_dim)
    return kernel.to(device=spec.device, dtype=DTYPES[spec.dtype]), parts


def make_inputs(spec: Spec, n: int, kernel: AttentionKernel) -> tuple[Tensor, Tensor, Tensor]:
    """q ~ randn (B, H, n, qk_dim), k ~ randn (B, H, n m, qk_dim) and v ~ randn
    (B, H, n m, D) that require grad, m the kernel's ``keys_per_token``."""
    dtype = DTYPES[spec.dtype]
    steps = n * kernel.keys_per_token
    return tuple(  # type: ignore[return-value]
        torch.randn(
            (spec.batch, spec.heads, tokens, d), device=spec.device, dtype=dtype,
            requires_grad=True,
        )
        for tokens, d in ((n, kernel.qk_dim), (steps, kernel.qk_dim), (steps, spec.head_dim))
    )  # fmt: skip


def fused_widths(kernel: AttentionKernel, spec: Spec) -> list[int]:
    """The widths of q, k and v in the layer's fused projection (k and v ``keys_per_token``
    times as wide)."""
    m = kernel.keys_per_token
    return [spec.heads * d for d in (kernel.qk_dim, m * kernel.qk_dim, m * spec.head_dim)]


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
    m = kernel.keys_per_token  # a token's m keys laid out (m, H, D), as the layer's
    q, k, v = (
        t.view(b, n, width, spec.heads, -1).permute(0, 3, 1, 2, 4).flatten(2, 3)
        for t, width in zip(mixed.split(fused_widths(kernel, spec), dim=-1), (1, m, m), strict=True)
    )
    gates = gates or {}
    for t in gates.values():
        t.grad = None
    if kernel.unit_keys:  # the delta rule takes unit keys, as its layer gives
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
    return set_malloc((M_MMAP_THRESHOLD, 32 * MIB), (M_TRIM_THRESHOLD, 64 * MIB))


def prepare(spec: Spec) -> Callable[[], None]:
    """One fwd+bwd pass of ``spec``'s kernel at ``spec.n``, ready to call: the kernel
    built, the libraries loaded by a tiny pass, a compiled kernel compiled for this N."""
    torch.manual_seed(0)
    kernel, parts = build_variant(spec)
    fused = bool(parts.short_conv) or spec.variant in FUSED_VARIANTS
    conv = None
    if parts.short_conv:
        conv = ShortConvolution(sum(fused_widths(kernel, spec)), parts.short_conv)
        conv = conv.to(device=spec.device, dtype=DTYPES[spec.dtype])

    def run_at(n: int) -> Callable[[], None]:
        if fused:  # q, k, v as views of the layer's fused projection
            x = torch.cat(
                [
                    t.transpose(1, 2).reshape(spec.batch, n, -1)
                    for t in make_inputs(spec, n, kernel)
                ],
                dim=-1,
            ).detach()
            x.requires_grad_()  # (B, N, H (2 qk_dim + D))
            gates = make_gates(kernel, spec, n)
            return lambda: fwd_bwd_fused(kernel, conv, x, spec, gates)
        q, k, v = make_inputs(spec, n, kernel)
        if kernel.unit_keys:  # the delta rule takes unit keys, as its layer gives
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
