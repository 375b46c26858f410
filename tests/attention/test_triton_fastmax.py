"""``attention.backend=triton``, our fused kernel for fastmax p=2, equals our loop: run on
the CPU under Triton's interpreter (tests/triton_cpu.py), in float32, outputs, gradients
and the state it hands to decoding, at a remainder chunk, padded and not; three broken
kernels fail the comparison; its memory grows linearly with N; its bad inputs, one line
each. bf16 and its speed wait for a GPU (``make gpu-window``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from transformers_lab.attention import triton_ops
from transformers_lab.attention.fastmax import FastmaxAttention
from transformers_lab.attention.feature_map.chunked import chunked_causal
from transformers_lab.attention.feature_map.features import weighted_state
from transformers_lab.attention.resolve import kernel_factory

TOL = 2e-5  # relative, |a - b| / |b| over the whole tensor, float32
CHUNK = 16  # the kernel's chunk here: 37 tokens leave a remainder, 80 are five chunks


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter on, the kernel's chunks of 16 tokens."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import triton_cpu

    triton_cpu.interpret()
    monkeypatch.setattr(triton_ops, "CHUNK", CHUNK)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def kernels(head_dim: int = 16, **options):
    """Our loop's fastmax p=2 and the Triton kernel's, the same options."""
    loop = FastmaxAttention(head_dim, 2, backend="loop", impl="linear", chunk_size=8, **options)
    fused = FastmaxAttention(head_dim, 2, backend="triton", **options)
    fused.load_state_dict(loop.state_dict())
    return loop, fused


def inputs(n: int, padded: bool, head_dim: int = 16):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, head_dim, requires_grad=True) for _ in range(3))
    mask = None
    if padded:  # one sequence padded at its end, the other at its start
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[0, -7:], mask[1, :3] = True, True
    return q, k, v, mask


def compare(loop, fused, n: int, padded: bool) -> tuple[float, float]:
    """The relative errors of the output and of the gradients of q, k, v (one vector)."""
    q, k, v, mask = inputs(n, padded, loop.head_dim)
    found = []
    for kernel in (loop, fused):
        out = kernel(q, k, v, causal=True, key_padding_mask=mask)
        if mask is not None:
            out = out.masked_fill(mask[:, None, :, None], 0.0)  # padded queries: don't-care
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        found.append((out, torch.cat([g.flatten() for g in grads])))
    (want, want_grad), (got, got_grad) = found
    return rel(got, want), rel(got_grad, want_grad)


@pytest.mark.parametrize(("n", "padded"), [(37, False), (80, True)], ids=["37", "80-padded"])
def test_the_triton_kernel_equals_our_loop_outputs_and_gradients(interpreter, n, padded):
    loop, fused = kernels()
    errors = compare(loop, fused, n, padded)
    assert max(errors) < TOL, errors


def test_its_state_is_the_engines_and_a_prefill_continues_it(interpreter):
    """The state after the last key equals our loop's (``weighted_state`` of every key); a
    prefill from a state gives what the whole sequence gives; ``decode`` of several tokens
    on the kernel equals ``decode`` on our loop, output and state."""
    torch.manual_seed(2)
    q, k, v = (torch.nn.functional.normalize(torch.randn(1, 2, 37, 16), dim=-1) for _ in "qkv")
    v_aug = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    out, state = triton_ops.triton_fastmax(q, k, v, want_state=True)
    assert rel(state, weighted_state(v_aug, k, 2)) < TOL
    _, loop_state = chunked_causal(q, k, v_aug, 2, 8)
    assert rel(state, loop_state) < TOL
    first, mid = triton_ops.triton_fastmax(
        q[:, :, :20], k[:, :, :20], v[:, :, :20], want_state=True
    )
    rest, end = triton_ops.triton_fastmax(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], state=mid,
                                          want_state=True)  # fmt: skip
    assert rel(torch.cat([first, rest], dim=2), out) < TOL and rel(end, state) < TOL
    loop, fused = kernels()
    with torch.no_grad():
        for kernel in (loop, fused):
            kernel.eval()
        _, s_loop = loop.decode(q[:, :, :20], k[:, :, :20], v[:, :, :20])
        _, s_fused = fused.decode(q[:, :, :20], k[:, :, :20], v[:, :, :20])
        o_loop, s_loop = loop.decode(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], s_loop)
        o_fused, s_fused = fused.decode(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], s_fused)
    assert rel(o_fused, o_loop) < TOL and rel(s_fused, s_loop) < TOL


def test_a_prefill_from_a_state_has_our_loops_gradients(interpreter):
    """The backward pass starts from the state given (its queries read the earlier keys
    too): the gradients of the new tokens' q, k and v equal our loop's from that state."""
    torch.manual_seed(3)
    q, k, v = (torch.nn.functional.normalize(torch.randn(1, 2, 37, 16), dim=-1) for _ in "qkv")
    ones = torch.ones_like(v[..., :1])
    _, state = triton_ops.triton_fastmax(q[:, :, :20], k[:, :, :20], v[:, :, :20], want_state=True)
    found = []
    for fused in (False, True):
        qn, kn, vn = (t[:, :, 20:].clone().requires_grad_() for t in (q, k, v))
        if fused:
            out, _ = triton_ops.triton_fastmax(qn, kn, vn, state=state)
        else:
            num, _ = chunked_causal(qn, kn, torch.cat([vn, ones[:, :, 20:]], -1), 2, 8, state)
            out = num[..., :-1] / num[..., -1:]
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), (qn, kn, vn))
        found.append((out, torch.cat([g.flatten() for g in grads])))
    assert rel(found[1][0], found[0][0]) < TOL and rel(found[1][1], found[0][1]) < TOL


def test_the_kernel_through_its_config_at_head_width_32(interpreter):
    """``attention=fastmax_p2 attention.backend=triton`` as a run builds it, D=32."""
    loop = kernel_factory("fastmax_p2", {"backend": "loop"})(head_dim=32, n_head=2)
    fused = kernel_factory("fastmax_p2", {"backend": "triton"})(head_dim=32, n_head=2)
    assert fused.backend == "triton"
    errors = compare(loop, fused, 37, padded=False)
    assert max(errors) < TOL, errors


@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.slow)])
def test_the_wide_heads_tiles_equal_our_loop(interpreter, head_dim):
    """D=64 (two rows of S2 a program) and D=128 (one, and two blocks of value columns; 33 s
    interpreted: the slow suite): one sequence, one head, a remainder chunk."""
    loop = FastmaxAttention(head_dim, 1, backend="loop", impl="linear", chunk_size=8)
    fused = FastmaxAttention(head_dim, 1, backend="triton")
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 1, 21, head_dim, requires_grad=True) for _ in range(3))
    found = []
    for kernel in (loop, fused):
        out = kernel(q, k, v, causal=True)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(),
                                    (q, k, v))  # fmt: skip
        found.append((out, torch.cat([g.flatten() for g in grads])))
    assert rel(found[1][0], found[0][0]) < TOL and rel(found[1][1], found[0][1]) < TOL


# ------------------------------------------------------------------ it can fail


@pytest.mark.parametrize(
    ("weights", "normaliser"),
    [
        pytest.param((1.0, 1.1, 0.605), (1.0, 1.1, 0.605), id="a-wrong-scale"),  # f(1.1 x)
        pytest.param((1.0, 1.0, 0.0), (1.0, 1.0, 0.0), id="a-dropped-second-order"),
        pytest.param((1.0, 1.0, 0.5), (1.0, 1.0, 1.0), id="a-wrong-normaliser"),
    ],
)
def test_a_broken_kernel_fails_the_comparison(interpreter, monkeypatch, weights, normaliser):
    monkeypatch.setattr(triton_ops, "WEIGHTS", weights)
    monkeypatch.setattr(triton_ops, "NORMALISER", normaliser)
    loop, fused = kernels()
    errors = compare(loop, fused, 37, padded=False)
    assert min(errors) > 1e-3, errors


# ------------------------------------------------------------------ memory


def allocated(fn) -> int:
    """Bytes that torch allocates on the CPU while ``fn`` runs, every allocation summed."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:  # fmt: skip
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def test_its_memory_grows_linearly_with_n(interpreter):
    """Forward and backward at N and 8 N: the kernel's allocations grow about 8 times (its
    inputs and outputs; no N x N, no N x F features), where the quadratic path's, measured
    the same way, grow more than 20 times."""

    def run(kernel, n):
        q, k, v, _ = inputs(n, padded=False)
        return lambda: kernel(q, k, v, causal=True).sum().backward()

    fused = kernels()[1]
    quadratic = FastmaxAttention(16, 2, backend="loop", impl="quadratic")
    small, large = 64, 512
    growth = allocated(run(fused, large)) / allocated(run(fused, small))
    reference = allocated(run(quadratic, large)) / allocated(run(quadratic, small))
    assert growth < 10.0 < 20.0 < reference, (growth, reference)


# ------------------------------------------------------------------ bad input


def test_a_head_width_it_does_not_take_is_one_line(interpreter):
    line = (r"^fastmax: attention.backend=triton: the fused fastmax kernel takes head widths 16, "
            r"32, 64, 128, got 24; use attention.backend=auto$")  # fmt: skip
    with pytest.raises(ValueError, match=line):
        FastmaxAttention(24, 2, backend="triton")


def test_p1_on_the_triton_kernel_is_one_line(interpreter):
    with pytest.raises(ValueError, match=r"^fastmax: attention.backend=triton is a kernel for p=2"):
        FastmaxAttention(16, 2, p=1, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_the_triton_kernel_without_cuda_is_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^fastmax: attention.backend=triton cannot run on this "
                       r"machine: no CUDA GPU is visible"):  # fmt: skip
        FastmaxAttention(64, 8, backend="triton")


def test_the_triton_kernel_on_another_kernel_is_one_line():
    with pytest.raises(ValueError, match=r"^based: attention.backend=triton is not a fused kernel "
                       r"for based \(it takes auto, loop, fla, flex\)"):  # fmt: skip
        kernel_factory("based", {"backend": "triton"})(head_dim=16, n_head=2)


# ------------------------------------------------------------------ for a GPU


@pytest.mark.slow  # 12 compiles, about a minute
def test_every_kernel_compiles_for_an_h100_at_the_widest_heads(tmp_path):
    """Triton's compiler, ahead of time, for compute capability 9.0 (H100, H200): forward
    and both backward kernels, D = 64 and 128 (the most shared memory), bf16 and fp32,
    within the 228 KiB of shared memory a block may have there. In a process of its own,
    with the interpreter off."""
    code = (
        "import json\nfrom transformers_lab.attention.triton_ops import compile_kernels\n"
        "print(json.dumps(compile_kernels(90, (64, 128))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(found) == 3 * 2 * 2
    assert all(0 < k["shared"] <= 228 * 1024 for k in found), found
