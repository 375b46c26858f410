"""``attention.backend=fla`` equals our loop: fla's Triton kernels, run on the CPU under
Triton's interpreter (tests/triton_cpu.py), against our chunk loops in float32, outputs and
every gradient, at two lengths (one leaving a remainder chunk), with padding, and in the
layer with its parts on. bf16 waits for a GPU (tests/gpu).

The delta rule without a decay, and the delta product, run in float32 only with fla's
assertion lifted (fla's ``chunk_delta_rule`` and ``chunk_gated_delta_product`` refuse
float32, and so do we, ``fla_ops.DELTA_RULE_HALF_ONLY``): the tests lift both, nothing
else does.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import get_class

from transformers_lab.attention import fla_ops
from transformers_lab.attention.resolve import kernel_factory, layer_factory
from transformers_lab.config import attention_configs
from transformers_lab.nn.multihead import MultiHeadAttention

CONFIGS = attention_configs()
# the options fla covers, each config once (fastmax is fastmax_p2)
FLA = sorted(
    {
        json.dumps(c, sort_keys=True): name
        for name, c in sorted(CONFIGS.items(), reverse=True)
        if "fla" in get_class(c["_target_"]).fused_backends
    }.values()
)
# fla's chunks are 64 tokens, ours 16 here: 37 leaves a remainder in both, unpadded (no mask
# given); 80 spans two of fla's chunks, padded at both ends (in the first and in the last)
CASES = [pytest.param(37, False, id="37-unpadded"), pytest.param(80, True, id="80-padded")]
TOL = 2e-5  # relative, |a - b| / |b| over the whole tensor, float32


@pytest.fixture(scope="module")
def interpreter():
    """fla's ops interpreted on the CPU, the delta rule's float32 refusals lifted, for this
    module's tests only."""
    if "fla" in sys.modules and "triton_cpu" not in sys.modules:
        pytest.fail("fla was imported before Triton's interpreter was on: its kernels are compiled")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        import triton_cpu

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fla: "Triton is not supported ... CPU"
                ops = triton_cpu.fla_ops()
        except ImportError as exc:
            pytest.fail(f"fla-core is not installed ({exc}): make install installs it")
        chunk = importlib.import_module("fla.ops.delta_rule.chunk")
        mp.setattr(chunk, "torch", NoFloat32Torch())
        product = importlib.import_module("fla.ops.gated_delta_product")
        mp.setattr(product, "chunk_gated_delta_product", delta_product_in_float32)
        mp.setattr(fla_ops, "DELTA_RULE_HALF_ONLY", False)
        yield ops


class NoFloat32Torch:
    """torch, but for ``float32``: fla's delta rule asserts ``q.dtype != torch.float32``."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def delta_product_in_float32(q, k, v, g, beta, num_householder, scale):
    """fla's ``chunk_gated_delta_product`` without its float32 assertion: its autograd
    function, called as the op calls it (zero initial state, no final state, no varlen)."""
    chunk = importlib.import_module("fla.ops.gated_delta_product.chunk")
    return chunk.ChunkGatedDeltaProductFunction.apply(
        q, k, v, g, beta, scale, num_householder, None, False, False, None, None, None
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def kernels(name: str, head_dim: int = 16, **options):
    """Our loop's kernel and fla's, the same parameters (our chunks of 16 where it has any)."""
    if "chunk_size" in inspect.signature(get_class(CONFIGS[name]["_target_"])).parameters:
        options = {"chunk_size": 16, **options}
    factory = kernel_factory(name, {**options, "backend": "loop"})
    loop = factory(head_dim=head_dim, n_head=2)
    fla = kernel_factory(name, {**options, "backend": "fla"})(head_dim=head_dim, n_head=2)
    fla.load_state_dict(loop.state_dict())
    return loop, fla


def inputs(kernel, n: int, padded: bool):
    torch.manual_seed(1)
    steps = n * kernel.keys_per_token  # Gated DeltaProduct's n_h keys a token
    q = torch.randn(2, 2, n, kernel.qk_dim)
    k = torch.randn(2, 2, steps, kernel.qk_dim)
    if kernel.unit_keys:  # the delta rule takes unit keys, as its layer gives
        k = F.normalize(k, dim=-1)
    v = torch.randn(2, 2, steps, kernel.head_dim)
    gates = kernel.sample_gates(2, n)
    mask = None
    if padded:  # one sequence padded at its end, the other at its start
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[0, -7:], mask[1, :3] = True, True
    leaves = [t.requires_grad_() for t in (q, k, v, *gates.values())]
    return (q, k, v), gates, mask, leaves


def compare(loop, fla, n: int, padded: bool) -> tuple[float, float]:
    """The relative errors of fla's output and gradients (inputs, gates and the kernel's
    parameters, one vector) against our loop's, on the rows that are not padding."""
    qkv, gates, mask, leaves = inputs(loop, n, padded)
    results = []
    for kernel in (loop, fla):
        out = kernel(*qkv, causal=True, key_padding_mask=mask, **gates)
        if mask is not None:
            out = out.masked_fill(mask[:, None, :, None], 0.0)  # padded queries: don't-care
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        wrt = [*leaves, *kernel.parameters()]
        grads = torch.autograd.grad((out * weights).sum(), wrt, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(t) if g is None else g).flatten()
                          for t, g in zip(wrt, grads, strict=True)])  # fmt: skip
        results.append((out, flat))
    (want, want_grad), (got, got_grad) = results
    return rel(got, want), rel(got_grad, want_grad)


@pytest.mark.parametrize(("n", "padded"), CASES)
@pytest.mark.parametrize("name", FLA)
def test_the_fla_backend_equals_our_loop_outputs_and_gradients(interpreter, name, n, padded):
    assert len(FLA) >= 15  # linear, performer, cosformer, based, fastmax p=1, p=2, 8 gated, fox
    loop, fla = kernels(name)
    errors = compare(loop, fla, n, padded)
    assert max(errors) < TOL, errors


def on_cuda(name: str, module: str, monkeypatch):
    """The kernel on our loop, on fla and on ``auto``, with ``module``'s ``choose`` acting
    as on a CUDA device (fla for ``auto``)."""
    loop, fla = kernels(name)
    auto = kernels(name)[0]
    auto.backend = "auto"

    def as_on_cuda(backend, *_):
        return None if backend == "loop" else "fla"

    monkeypatch.setattr(f"{module}.choose", as_on_cuda)
    return loop, fla, auto


def test_auto_takes_our_loop_where_fla_refuses_the_dtype(interpreter, monkeypatch):
    """fla's delta rule takes no float32: ``auto`` runs our loop there (on CUDA too),
    ``fla`` says so in one line."""
    monkeypatch.setattr(fla_ops, "DELTA_RULE_HALF_ONLY", True)
    loop, fla, auto = on_cuda("deltanet", "transformers_lab.attention.gated.kernel", monkeypatch)
    qkv, gates, _, _ = inputs(loop, 20, padded=False)
    assert torch.equal(auto(*qkv, causal=True, **gates), loop(*qkv, causal=True, **gates))
    with pytest.raises(ValueError, match="fla's delta rule runs in bf16 or fp16 only"):
        fla(*qkv, causal=True, **gates)


def test_rwkv7_under_auto_takes_our_loop_in_float32(interpreter, monkeypatch):
    """fla warns that its DPLR op may be wrong in float32 on some GPUs: ``auto`` runs our
    loop there (on CUDA too), bit for bit; ``fla`` named runs fla's op."""
    loop, fla, auto = on_cuda("rwkv7", "transformers_lab.attention.rwkv7", monkeypatch)
    qkv, gates, _, _ = inputs(loop, 20, padded=False)
    want = loop(*qkv, causal=True, **gates)
    assert torch.equal(auto(*qkv, causal=True, **gates), want)
    got = fla(*qkv, causal=True, **gates)
    assert not torch.equal(got, want) and rel(got, want) < TOL  # fla's op, to rounding


@pytest.mark.parametrize("name", ["gla", "deltanet", "fastmax_p1", "linear", "rwkv7"])
def test_an_odd_head_width_goes_to_fla_padded_even(interpreter, name):
    """fla's 16-bit backward takes even widths only: an odd one gets a zero channel, which
    changes nothing (fastmax p=1's [1, q] is odd at every even head width)."""
    loop, fla = kernels(name, head_dim=15)
    errors = compare(loop, fla, 37, padded=True)
    assert max(errors) < TOL, errors


def test_fastmax_with_a_learned_scale_takes_it_into_fla(interpreter):
    loop, fla = kernels("fastmax", learn_scale=True, scale=0.7)
    with torch.no_grad():
        for kernel in (loop, fla):
            kernel.log_scale.copy_(torch.tensor([-0.5, 0.2]).view(2, 1, 1))
    errors = compare(loop, fla, 37, padded=False)
    assert max(errors) < TOL, errors


PARTS = {"short_conv": 4, "qk_activation": "silu", "output_norm": True, "output_gate": True}


@pytest.mark.parametrize(
    "name",
    ["fastmax", "fastmax_p1", "based", "gated_deltanet", "gla", "gated_deltaproduct", "rwkv7"],
)
def test_in_the_layer_with_its_parts_on_fla_equals_our_loop(interpreter, name):
    """The multi-head layer (its short convolution, activation, output norm and gate on),
    one built on fla, one on our loop, the same weights: the output and the gradients of
    the input and of every parameter."""
    presets = ("gated_deltanet", "gla", "gated_deltaproduct", "rwkv7")
    parts = {} if name in presets else PARTS  # their presets' own
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 4, layer_factory(name, {**parts, "backend": "loop"}))
    assert layer.parts.output_norm and layer.parts.output_gate  # the parts are on
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    theirs = copy.deepcopy(layer)
    theirs.kernel = kernel_factory(name, {**parts, "backend": "fla"})(head_dim=16, n_head=4)
    theirs.kernel.load_state_dict(layer.kernel.state_dict())
    x = torch.randn(2, 45, 64)
    found = []
    for module in (layer, theirs):
        xi = x.clone().requires_grad_()
        out = module(xi, causal=True)
        out.pow(2).mean().backward()
        grads = torch.cat([xi.grad.flatten(), *(p.grad.flatten() for p in module.parameters())])
        found.append((out, grads))
    assert layer.kernel.backend == "loop" and theirs.kernel.backend == "fla"
    assert rel(found[1][0], found[0][0]) < TOL
    assert rel(found[1][1], found[0][1]) < TOL


# ------------------------------------------------------------------ they can fail


def test_a_wrong_scale_fails_the_comparison(interpreter, monkeypatch):
    loop, fla = kernels("retnet")
    real = fla_ops.fla_recurrence
    monkeypatch.setattr(
        fla_ops, "fla_recurrence", lambda *a, scale, **kw: real(*a, scale=scale * 1.05, **kw)
    )
    assert compare(loop, fla, 37, padded=False)[0] > 1e-3


def test_a_wrong_normalisation_fails_the_comparison(interpreter, monkeypatch):
    loop, fla = kernels("linear")
    chunk = interpreter.linear_attn.chunk_linear_attn
    monkeypatch.setattr(
        interpreter.linear_attn,
        "chunk_linear_attn",
        lambda *a, **kw: chunk(*a, **{**kw, "normalize": False}),
    )
    assert compare(loop, fla, 37, padded=False)[0] > 1e-3


def test_a_dropped_gate_fails_the_comparison(interpreter, monkeypatch):
    loop, fla = kernels("gla")
    real = fla_ops.fla_recurrence
    monkeypatch.setattr(
        fla_ops,
        "fla_recurrence",
        lambda q, k, v, log_decay=None, beta=None, **kw: real(q, k, v, None, beta, **kw),
    )
    assert compare(loop, fla, 37, padded=False)[0] > 1e-3


def test_rwkv7_with_alpha_and_beta_swapped_fails_the_comparison(interpreter, monkeypatch):
    loop, fla = kernels("rwkv7")
    real = fla_ops.fla_dplr
    monkeypatch.setattr(
        "transformers_lab.attention.rwkv7.fla_dplr",
        lambda q, k, v, log_w, alpha, beta, **kw: real(q, k, v, log_w, beta, alpha, **kw),
    )
    assert compare(loop, fla, 37, padded=False)[0] > 1e-3


def test_a_dropped_padding_fails_the_comparison(interpreter, monkeypatch):
    loop, fla = kernels("fastmax")
    real = fla_ops.fla_polynomial
    monkeypatch.setattr(
        "transformers_lab.attention.feature_map.feature_kernel.fla_polynomial",
        lambda qs, ks, v, p, keep=None: real(qs, ks, v, p, None),
    )
    assert compare(loop, fla, 37, padded=True)[0] > 1e-3
