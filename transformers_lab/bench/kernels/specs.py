"""What the bench measures: the variants (name -> kernel config: the attention options,
other paths of them, the compiled and fused-backend ones, fla's ops alone), and ``Spec``,
one measurement of one, with the columns of its result row."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_class, instantiate

from transformers_lab.attention import AttentionKernel, call_with_heads
from transformers_lab.attention.resolve import UnknownKernel, kernel_config
from transformers_lab.config import CONF_DIR, attention_configs
from transformers_lab.nn.parts import split_layer_parts

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
    "kda_no_conv": ("kda", {"short_conv": 0}),
    "gated_deltaproduct_no_conv": ("gated_deltaproduct", {"short_conv": 0}),
    "rwkv7_no_conv": ("rwkv7", {"short_conv": 0}),
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
# (its ``backend: fla`` / ``flex``; ``fastmax_p2_triton``, our own kernel), ``<option>_loop``
# for our loop on any device (on CUDA the option itself, ``backend: auto``, takes the fused
# kernel), and fla's ops alone, fed what our kernel would feed them: ``<option>_fla_op``
# (``bench.fla_kernels``), the reference our ``_fla`` is held to (goal: within 1.2x)
FLA, FLEX, LOOP, FLA_OP, TRITON = "_fla", "_flex", "_loop", "_fla_op", "_triton"
FLA_OPS: dict[str, dict[str, Any]] = {
    name + FLA_OP: {"_target_": f"transformers_lab.bench.fla_kernels.{cls}", "_partial_": True}
    for name, cls in (("linear", "FlaLinearAttention"), ("based", "FlaBasedAttention"),
                      ("fastmax_p1", "FlaFastmaxP1"), ("fastmax_p2", "FlaFastmaxP2"))
}  # fmt: skip
GPU_ONLY = (FLA, FLEX, FLA_OP, TRITON)  # suffixes of the variants that need --device cuda


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
            if backend == "triton" and c.get("p") != 2:
                continue  # our Triton kernel is fastmax p=2's
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


def build(config: str, heads: int, head_dim: int) -> AttentionKernel:
    """The kernel of an attention config (JSON), the layer's switches it carries aside."""
    factory, _ = split_layer_parts(instantiate(json.loads(config)))
    return call_with_heads(factory, heads, head_dim=head_dim)


@functools.cache
def state_numbers(config: str, n: int, heads: int, head_dim: int) -> int:
    """Numbers a decoder keeps per sequence after ``n`` tokens with the kernel of this
    config (JSON; its ``state_size``): a KV cache grows with n, a linear state does not."""
    return build(config, heads, head_dim).state_size(n)


@functools.cache
def matmul_flops(config: str, n: int, causal: bool, heads: int, head_dim: int) -> int | None:
    """The matrix-product FLOPs of one fwd+bwd of a linear kernel (its ``matmul_flops``),
    one sequence; None for the others."""
    kernel = build(config, heads, head_dim)
    counter = getattr(kernel, "matmul_flops", None)
    return (
        None
        if counter is None or not getattr(kernel, "constant_state", False)
        else counter(n, causal)
    )


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
