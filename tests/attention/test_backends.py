"""``attention.backend``: which kernels a fused kernel covers, what ``auto`` takes, the
one-line refusals, FlexAttention's forward against our loop on the CPU, resuming across
backends and the bench's backend variants. fla's own equality with our loop is
test_fla_ops.py (under Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import get_class

from transformers_lab.attention import KERNELS, backends, build_kernel
from transformers_lab.attention.resolve import kernel_factory
from transformers_lab.bench import kernels as bench
from transformers_lab.bench.kernels import worker
from transformers_lab.config import attention_configs

CONFIGS = attention_configs()
COVERED = sorted(n for n, c in CONFIGS.items() if get_class(c["_target_"]).fused_backends)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU as a user has it


def test_the_kernels_each_fused_kernel_covers():
    # the package's own kernels (a user's kernel that another test imported joins KERNELS)
    ours = {n: c for n, c in KERNELS.items() if c.__module__.startswith("transformers_lab.")}
    covers = {name: cls.fused_backends for name, cls in ours.items() if cls.fused_backends}
    assert covers == {
        **dict.fromkeys(["linear", "performer", "cosformer"], ("fla",)),
        "based": ("fla", "flex"),
        "fastmax": ("fla", "flex", "triton"),  # triton: p=2 only
        **dict.fromkeys(["retnet", "gla", "simple_gla", "deltanet", "gated_deltanet"], ("fla",)),
        **dict.fromkeys(["kda", "fox", "gated_deltaproduct", "rwkv7"], ("fla",)),
        "sliding_window": ("flex",),
    }
    for name in COVERED:  # every option of a covered kernel says auto, and keeps it
        assert CONFIGS[name]["backend"] == "auto", name
        assert kernel_factory(name)(head_dim=8, n_head=2).backend == "auto"


@pytest.mark.parametrize("name", COVERED)
def test_auto_takes_our_loop_on_a_cpu(name):
    cls = get_class(CONFIGS[name]["_target_"])
    assert backends.choose("auto", cls.fused_backends, torch.device("cpu")) is None
    assert backends.choose("loop", cls.fused_backends, torch.device("cuda")) is None
    assert backends.choose("fla", cls.fused_backends, torch.device("cpu")) == "fla"


@pytest.mark.parametrize("name", COVERED)
def test_auto_on_a_cpu_gives_our_loop_bit_for_bit(name):
    loop = kernel_factory(name, {"backend": "loop"})(head_dim=16, n_head=2)
    auto = kernel_factory(name)(head_dim=16, n_head=2)
    auto.load_state_dict(loop.state_dict())
    torch.manual_seed(0)
    steps = 150 * loop.keys_per_token  # Gated DeltaProduct's n_h keys a token
    q = torch.randn(2, 2, 150, loop.qk_dim)
    k, v = torch.randn(2, 2, steps, loop.qk_dim), torch.randn(2, 2, steps, 16)
    if loop.unit_keys:  # the delta rule's, as its layer gives them
        k = torch.nn.functional.normalize(k, dim=-1)
    gates = loop.sample_gates(2, 150)
    assert torch.equal(auto(q, k, v, causal=True, **gates), loop(q, k, v, causal=True, **gates))


def test_null_is_our_loop_as_it_was_before_the_option_had_other_names():
    assert build_kernel("gla", head_dim=8, n_head=2, backend=None).backend == "loop"


@pytest.mark.parametrize(
    ("name", "backend", "message"),
    [
        ("gla", "cuda", r"^gla: unknown attention.backend='cuda'; gla takes one of auto, "
                        r"loop, fla \(auto: "),
        ("gla", "triton", r"^gla: attention.backend=triton is not a fused kernel for gla \(it "
                          r"takes auto, loop, fla\); use "),
        ("fastmax", "cuda", r"^fastmax: unknown attention.backend='cuda'; fastmax takes one of "
                            r"auto, loop, fla, flex, triton"),
        ("sliding_window", "fla", r"^sliding_window: attention.backend=fla is not a fused kernel "
                                  r"for sliding_window \(it takes auto, loop, flex\); use "),
        ("linear", "flex", r"^linear: attention.backend=flex is not a fused kernel for linear "
                           r"\(it takes auto, loop, fla\);"),
    ],
)  # fmt: skip
def test_a_backend_that_is_not_one_or_does_not_cover_the_kernel_is_refused(name, backend, message):
    with pytest.raises(ValueError, match=message) as info:
        build_kernel(name, head_dim=8, n_head=2, backend=backend)
    assert "\n" not in str(info.value)


@no_cuda
@pytest.mark.parametrize("name", ["deltanet", "fastmax", "linear"])
def test_fla_without_cuda_is_refused_when_the_kernel_is_built(name):
    with pytest.raises(ValueError) as info:
        build_kernel(name, head_dim=8, n_head=2, backend="fla")
    message = str(info.value)
    assert "\n" not in message
    assert f"{name}: attention.backend=fla cannot run on this machine: no CUDA GPU" in message
    assert message.endswith("use attention.backend=auto (our loop here)")


def test_a_sliding_window_on_flex_takes_no_dropout():
    with pytest.raises(ValueError, match="attention.backend=flex has no dropout, got dropout=0.1"):
        build_kernel("sliding_window", head_dim=8, n_head=2, backend="flex", dropout=0.1)


# ------------------------------------------------------------------ FlexAttention, forward


def flex_pair(name: str, **options):
    loop = kernel_factory(name, {**options, "backend": "loop"})(head_dim=16, n_head=2)
    flex = kernel_factory(name, {**options, "backend": "flex"})(head_dim=16, n_head=2)
    flex.load_state_dict(loop.state_dict())
    return loop, flex


FLEX_CASES = [
    ("fastmax", {}),
    ("fastmax_p1", {}),
    ("based", {}),
    ("sliding_window", {"window": 8}),
    ("sliding_window", {"window": 5, "scale": 0.3}),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("name", "options"), FLEX_CASES)
def test_flex_equals_our_loop_forward(name, options, padded, causal):
    """FlexAttention's forward on the CPU (its backward is CUDA's: tests/gpu) against our
    loop, at a length that is no multiple of its blocks, padded keys masked."""
    loop, flex = flex_pair(name, **options)
    torch.manual_seed(0)
    n = 45
    q, k, v = (torch.randn(2, 2, n, 16) for _ in range(3))
    mask = None
    if padded:
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[0, -6:], mask[1, :4] = True, True
    with torch.no_grad():
        want = loop(q, k, v, causal=causal, key_padding_mask=mask)
        got = flex(q, k, v, causal=causal, key_padding_mask=mask)
    if mask is not None:
        want, got = (t.masked_fill(mask[:, None, :, None], 0.0) for t in (want, got))
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


def test_flex_with_alibi_equals_our_loop():
    loop, flex = flex_pair("sliding_window", window=6)
    for kernel in (loop, flex):
        kernel.use_alibi()
    q, k, v = (torch.randn(1, 2, 30, 16) for _ in range(3))
    with torch.no_grad():
        assert torch.allclose(flex(q, k, v, causal=True), loop(q, k, v, causal=True), atol=2e-6)


def test_flex_on_cuda_refuses_heads_narrower_than_its_kernel_takes():
    from transformers_lab.attention.flex_ops import refusal

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert refusal(8, 16, cuda).startswith("FlexAttention's CUDA kernel takes heads at least 16")
    assert refusal(16, 16, cuda) is None and refusal(8, 8, cpu) is None


def test_a_call_a_fused_kernel_cannot_take_goes_to_our_loop_unless_it_was_named():
    assert backends.settle("fastmax", "auto", "flex", "too narrow") is None
    assert backends.settle("fastmax", "auto", "fla", None) == "fla"
    with pytest.raises(ValueError, match=r"^fastmax: attention.backend=flex: too narrow; use "):
        backends.settle("fastmax", "flex", "flex", "too narrow")


def test_a_window_on_flex_decodes_on_its_ring_buffer():
    loop, flex = flex_pair("sliding_window", window=4)
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    states = [None, None]
    with torch.no_grad():
        for t in range(9):
            step = [x[:, :, t : t + 1] for x in (q, k, v)]
            (want, states[0]), (got, states[1]) = (
                kernel.decode(*step, state)
                for kernel, state in zip((loop, flex), states, strict=True)
            )
            assert torch.equal(got, want)


def test_a_wrong_window_fails_the_flex_comparison():
    loop, _ = flex_pair("sliding_window", window=8)
    _, flex = flex_pair("sliding_window", window=9)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with torch.no_grad():
        assert (flex(q, k, v, causal=True) - loop(q, k, v, causal=True)).abs().max() > 1e-2


def test_flex_asked_for_a_gradient_on_a_cpu_is_refused_in_one_line():
    _, flex = flex_pair("fastmax")
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    with pytest.raises(ValueError, match=r"^attention.backend=flex: FlexAttention's backward "):
        flex(q, q, q, causal=True)


# ------------------------------------------------------------------ checkpoints, bench


def test_a_checkpoint_moves_between_backends():
    from transformers_lab.run.checkpoints import RESUME_MAY_CHANGE, differences

    here = {"model": {"attention": CONFIGS["fastmax"]}}
    for backend in ("loop", "fla", "flex", None):
        saved = {"model": {"attention": {**CONFIGS["fastmax"], "backend": backend}}}
        assert differences(saved, here, RESUME_MAY_CHANGE) == []
    old = {key: value for key, value in CONFIGS["gla"].items() if key != "backend"}
    new = {"model": {"attention": CONFIGS["gla"]}}
    assert differences({"model": {"attention": old}}, new, RESUME_MAY_CHANGE) == []


def test_the_bench_names_every_backend_of_every_covered_option_and_leaves_them_out_by_default():
    found = bench.variants()
    options = [name for name in COVERED if name in found]  # fastmax is fastmax_p2 there
    assert len(options) == len(COVERED) - 1
    for name in options:
        covers = get_class(CONFIGS[name]["_target_"]).fused_backends
        for backend in ("loop", *covers):
            if backend == "triton" and CONFIGS[name]["p"] != 2:
                assert f"{name}_triton" not in found  # our Triton kernel is fastmax p=2's
                continue
            assert found[f"{name}_{backend}"] == {**found[name], "backend": backend}
    assert "fastmax_p2_triton" in found
    assert {n for n in found if n.endswith(bench.FLA_OP)} == {
        "linear_fla_op", "based_fla_op", "fastmax_p1_fla_op", "fastmax_p2_fla_op"
    }  # fmt: skip
    chosen = set(bench.default_variants())
    assert not {n for n in chosen if n.endswith((bench.LOOP, *bench.GPU_ONLY))}
    assert "fastmax_p2" in chosen and "gla" in chosen


def test_measuring_in_process_turns_failures_into_rows_and_slow_variants_stop(monkeypatch):
    spec = bench.Spec(variant="softmax", causal=True, n=64)

    def broken(_spec):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(worker, "measure_once", broken)
    row = bench.measure_here(spec, timeout=60)
    assert row["status"] == "error: RuntimeError: CUDA out of memory"
    assert not bench.too_slow(row, spec, timeout=60)

    monkeypatch.setattr(worker, "measure_once", lambda s: s.row(time_ms=5000.0, peak_mib=1.0))
    row = bench.measure_here(spec, timeout=60)
    assert row["status"] == "ok" and row["time_ms"] == 5000.0  # a slow row keeps its figure
    assert not bench.too_slow(row, spec, timeout=60)  # 5 passes of 5 s: 25 s
    assert bench.too_slow(row, spec, timeout=20)  # the variant's longer N is left out
