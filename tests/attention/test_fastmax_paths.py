"""The four fastmax paths (quadratic, factorized, chunked causal, recurrent) agree."""

from __future__ import annotations

import pytest
import torch

from transformers_lab.attention import FastmaxAttention
from transformers_lab.attention import feature_map as fm
from transformers_lab.nn.parts import split_layer_parts

B, H, D, DV = 2, 3, 6, 5
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-10}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


def inputs(nq, nk, dtype, p, padded):
    kernel = FastmaxAttention(
        head_dim=D, n_head=H, impl="linear", p=p, scale=0.9 if p == 1 else 1.7
    )
    q = torch.randn(B, H, nq, D, dtype=torch.float64)
    k = torch.randn(B, H, nk, D, dtype=torch.float64)
    v = torch.randn(B, H, nk, DV, dtype=torch.float64)
    mask = None
    if padded:
        mask = torch.zeros(B, nk, dtype=torch.bool)
        mask[0, :2] = True  # left padding in one row
        mask[1, -3:] = True  # right padding in the other
    qs, ks, v_aug = kernel.prepare(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    return kernel, qs, ks, v_aug, mask


def recurrent(qs, ks, v_aug, p, state=None):
    """Run the recurrent step over every key, reading the output of the last Nq steps."""
    nq, nk = qs.shape[2], ks.shape[2]
    outs = []
    for t in range(nk):
        i = t - (nk - nq)  # the query aligned to key t, if any
        q_t = qs[:, :, i : i + 1] if i >= 0 else torch.zeros_like(qs[:, :, :1])
        out, state = fm.recurrent_step(q_t, ks[:, :, t : t + 1], v_aug[:, :, t : t + 1], p, state)
        if i >= 0:
            outs.append(out)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize(("nq", "nk"), [(23, 23), (5, 23), (23, 14)])
@pytest.mark.parametrize("chunk", [4, 7, 64])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("group", [None, 4])  # chunks a step; 4: 6 chunks go as 4 and 2
def test_causal_paths_agree(dtype, p, nq, nk, chunk, padded, group):
    _, qs, ks, v_aug, _ = inputs(nq, nk, dtype, p, padded)
    reference = fm.quadratic(qs, ks, v_aug, p, causal=True)
    chunked, state = fm.chunked_causal(qs, ks, v_aug, p, chunk, group=group)
    torch.testing.assert_close(chunked, reference, **TOL[dtype])
    if nk >= nq:
        stepped, rec_state = recurrent(qs, ks, v_aug, p)
        torch.testing.assert_close(stepped, reference, **TOL[dtype])
        torch.testing.assert_close(rec_state, state, **TOL[dtype])
    # normalised outputs agree too
    torch.testing.assert_close(
        fm.normalise_output(chunked), fm.normalise_output(reference), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize(("nq", "nk"), [(17, 17), (4, 17), (17, 6)])
@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_noncausal_paths_agree(dtype, p, nq, nk, chunk, padded):
    _, qs, ks, v_aug, _ = inputs(nq, nk, dtype, p, padded)
    reference = fm.quadratic(qs, ks, v_aug, p, causal=False)
    factorized = fm.factorized(qs, ks, v_aug, p, chunk)
    torch.testing.assert_close(factorized, reference, **TOL[dtype])
    # the recurrent state after every key, queried once, is the non-causal answer
    _, state = recurrent(ks, ks, v_aug, p)
    torch.testing.assert_close(fm.read_state(qs, state, p), reference, **TOL[dtype])


@pytest.mark.parametrize("p", [1, 2])
def test_feature_map_factorises_the_polynomial(p):
    for d in (D, D + 1):  # odd and even D + 1
        a, b = torch.randn(10, d, dtype=torch.float64), torch.randn(12, d, dtype=torch.float64)
        phi_a, phi_b = fm.feature_map(a, p), fm.feature_map(b, p)
        assert phi_a.shape[-1] == fm.feature_dim(d, p)
        w = fm.feature_weights(d, p, torch.float64)
        torch.testing.assert_close((w * phi_a) @ phi_b.T, fm.poly(a @ b.T, p))
    assert fm.feature_dim(32, 2) == 1 + 32 + 32 * 33 // 2


def test_module_decode_prefill_then_steps_matches_forward():
    kernel = FastmaxAttention(head_dim=D, n_head=H, chunk_size=4, impl="linear")
    q, k, v = (torch.randn(B, H, 19, n, dtype=torch.float64) for n in (D, D, DV))
    full = kernel(q, k, v, causal=True)
    out, state = kernel.decode(q[:, :, :10], k[:, :, :10], v[:, :, :10])
    outs = [out]
    for t in range(10, 19):
        out, state = kernel.decode(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state
        )
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-10, atol=1e-12)
    # the state does not grow with the context
    assert state.shape == (B, H, DV + 1, fm.feature_dim(D, 2))


def test_decode_with_padding_matches_forward_with_padding():
    kernel = FastmaxAttention(head_dim=D, n_head=H, impl="linear")
    q, k, v = (torch.randn(B, H, 8, n, dtype=torch.float64) for n in (D, D, DV))
    mask = torch.zeros(B, 8, dtype=torch.bool)
    mask[0, :3] = True
    full = kernel(q, k, v, causal=True, key_padding_mask=mask)
    state, outs = None, []
    for t in range(8):
        out, state = kernel.decode(
            q[:, :, t : t + 1],
            k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            state,
            key_padding_mask=mask[:, t : t + 1],
        )
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), full, rtol=1e-10, atol=1e-12)


def test_chunked_never_builds_the_prefix_sum_of_outer_products():
    """The paper's causal path holds an N x F x Dv tensor. Ours holds at most the N x C
    scores of the chunks, the N x F features, or one state per chunk."""
    n, c = 256, 32
    q, k = torch.randn(1, 1, n, D), torch.randn(1, 1, n, D)
    v_aug = torch.randn(1, 1, n, DV + 1)
    largest = 0

    def pack(t):
        nonlocal largest
        largest = max(largest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fm.chunked_causal(q.requires_grad_(), k.requires_grad_(), v_aug.requires_grad_(), 2, c)
    f = fm.feature_dim(D, 2)
    assert largest < n * f * (DV + 1) / 4
    assert largest <= max(n * c, n * f, n // c * f * (DV + 1))


def test_float32_states_under_autocast():
    kernel = FastmaxAttention(head_dim=D, n_head=H, impl="linear")
    q, k, v = (torch.randn(B, H, 12, n) for n in (D, D, DV))
    expected = kernel(q, k, v, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
        _, state = kernel.decode(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    assert state.dtype == torch.float32
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)


def test_normalisation_uses_each_token_alone():
    """Scaling one key changes no other token's normalised key (no max over the sequence)."""
    kernel = FastmaxAttention(head_dim=D, n_head=H, impl="linear")
    q, k, v = (torch.randn(B, H, 6, n, dtype=torch.float64) for n in (D, D, DV))
    _, ks, _ = kernel.prepare(q, k, v, None)
    k2 = k.clone()
    k2[:, :, -1] *= 1000.0
    _, ks2, _ = kernel.prepare(q, k2, v, None)
    torch.testing.assert_close(ks2[:, :, :-1], ks[:, :, :-1], rtol=0, atol=0)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("d", [4, 5])
def test_feature_vjp_matches_autograd(p, d):
    ut_t = torch.randn(3, d + 1, 7, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, fm.feature_dim(d, p), 7, dtype=torch.float64)
    phi_t = fm.features_t(ut_t, p)
    (expected,) = torch.autograd.grad(phi_t, ut_t, grad)
    torch.testing.assert_close(fm.features_t_vjp(ut_t.detach(), grad, p), expected)
    with torch.no_grad():  # the autograd-free branch computes the same features
        torch.testing.assert_close(fm.features_t(ut_t, p), phi_t)


@pytest.mark.parametrize("p", [0, 1, 2])
@pytest.mark.parametrize(("nq", "nk"), [(7, 7), (3, 8), (8, 5), (11, 11)])
@pytest.mark.parametrize("group", [1, 2])
def test_chunked_backward_passes_gradcheck_across_chunks(p, nq, nk, group):
    """Several chunks, a chunk that does not divide N, a state carried in and out, and
    steps of one chunk or of groups (chunks of 3: 8 tokens go as 2 chunks and 1, 11 as 2
    and 2)."""
    d, dv = 3, 2
    q = torch.randn(1, 2, nq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, nk, d, dtype=torch.float64, requires_grad=True)
    v_aug = torch.randn(1, 2, nk, dv + 1, dtype=torch.float64, requires_grad=True)
    state = torch.randn(1, 2, dv + 1, fm.feature_dim(d, p), dtype=torch.float64)
    state.requires_grad_()

    def fn(q, k, v_aug, state):
        out, final = fm.chunked_causal(q, k, v_aug, p, chunk_size=3, state=state, group=group)
        return out, final

    assert torch.autograd.gradcheck(fn, (q, k, v_aug, state))
    if group == 2:
        return  # the non-causal path has no groups

    def noncausal(q, k, v_aug):
        return fm.factorized(q, k, v_aug, p, chunk_size=3)

    assert torch.autograd.gradcheck(noncausal, (q, k, v_aug))


def test_double_backward_is_refused_not_wrong():
    """The hand-written backward passes are first-order only: asking for a second order
    raises instead of returning silently wrong numbers."""
    kernel = FastmaxAttention(head_dim=D, n_head=H, impl="linear")
    q, k, v = (torch.randn(1, H, 6, n, requires_grad=True) for n in (D, D, DV))
    for causal in (False, True):
        out = kernel(q, k, v, causal=causal)
        with pytest.raises(RuntimeError, match="first-order gradients only"):
            torch.autograd.grad(out.square().sum(), q, create_graph=True)
        (gq,) = torch.autograd.grad(out.square().sum(), q)  # first order still works
        assert torch.isfinite(gq).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["fastmax_p2", "fastmax_p1", "linear", "based", "performer",
                                     "cosformer"])  # fmt: skip
def test_matmul_flops_counts_what_the_linear_paths_run(variant, causal):
    from hydra.utils import instantiate
    from torch.utils.flop_counter import FlopCounterMode

    from transformers_lab.config import attention_configs

    config = attention_configs(names=[variant])[variant]  # this option alone composed
    kernel = split_layer_parts(instantiate(config))[0](head_dim=8, n_head=2)
    kernel.impl, kernel.chunk_size = "linear", 16
    d = kernel.qk_dim  # Based's feature_dim
    q, k, v = (torch.randn(1, 2, 40, w, requires_grad=True) for w in (d, d, 8))  # 40: padded
    with FlopCounterMode(display=False) as counter:
        kernel(q, k, v, causal=causal).sum().backward()
    assert counter.get_total_flops() == kernel.matmul_flops(40, causal)


# ------------------------------------------------------------------ compiled chunk steps


def gradients(kernel, q, k, v, causal: bool):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = kernel(q, k, v, causal=causal)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fastmax", "linear"])
def test_compiled_chunk_steps_give_the_eager_results(name):
    # torch.compile of each step (a fused feature map, polynomial and VJP for p=2), in
    # both linear paths, forward and backward, against the eager steps
    from transformers_lab.attention import build_kernel
    from transformers_lab.attention.feature_map.steps import steps

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    eager = build_kernel(name, head_dim=8, n_head=2, chunk_size=16, impl="linear")
    compiled = build_kernel(name, head_dim=8, n_head=2, chunk_size=16, impl="linear", compiled=True)
    for causal in (True, False):
        want = gradients(eager, q, k, v, causal)
        got = gradients(compiled, q, k, v, causal)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert "compiled=True" in repr(compiled)
    assert not any(fn.failed for fn in vars(steps(True)).values())


@pytest.mark.parametrize("causal", [True, False])
def test_a_compiled_step_compiles_once_for_every_sequence_length(monkeypatch, causal):
    # the paths hand the steps chunk-major blocks, whose strides do not depend on N, and the
    # causal path groups chunks by powers of two: once its block shapes have been seen, a
    # new N reuses the compiled code (Dynamo's graphs, counted by a backend that runs them
    # as they are)
    from torch._dynamo.testing import CompileCounter

    from transformers_lab.attention import build_kernel
    from transformers_lab.attention.feature_map import steps as steps_module

    counter, real = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": counter}))
    steps_module.steps.cache_clear()
    try:
        torch._dynamo.reset()
        kernel = build_kernel(
            "fastmax", head_dim=8, n_head=2, chunk_size=16, impl="linear", compiled=True
        )

        def run(n):
            q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
            kernel(q, k, v, causal=causal).sum().backward()

        for n in (16, 32, 64):  # causal: steps of 1, 2 and 4 chunks
            run(n)
        # forward and backward of 3 block shapes; non-causal: state, read and two grads
        assert counter.frame_count == (6 if causal else 4)
        for n in (48, 80, 112, 96):  # 3, 5, 7 and 6 chunks: 2 + 1, 4 + 1, 4 + 2 + 1, 4 + 2
            run(n)
        assert counter.frame_count == (6 if causal else 4)
        assert not any(fn.failed for fn in vars(steps_module.steps(True)).values())
    finally:
        steps_module.steps.cache_clear()  # later tests compile with the real backend
        torch._dynamo.reset()


def test_compiled_kernels_on_the_quadratic_path_say_once_a_class_that_it_is_not_compiled(
    monkeypatch, caplog
):
    # impl=auto takes the quadratic path while the keys are no more than the features
    # (fastmax p=2 with D=8: 45; linear: 8), whose N x N form has no compiled steps
    from transformers_lab.attention import build_kernel
    from transformers_lab.attention.feature_map import feature_kernel

    monkeypatch.setattr(feature_kernel, "UNCOMPILED_SAID", set())
    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    with caplog.at_level("WARNING"):
        build_kernel("fastmax", head_dim=8, n_head=2)(q, k, v)  # not compiled: nothing
        for name in ("fastmax", "fastmax", "linear"):  # two fastmax modules: one class
            kernel = build_kernel(name, head_dim=8, n_head=2, compiled=True)
            for causal in (True, False, True):
                kernel(q, k, v, causal=causal)
    said = [r.getMessage() for r in caplog.records if "runs uncompiled" in r.getMessage()]
    assert said == [
        "attention.compiled=true: fastmax runs uncompiled at 8 keys, on its quadratic path "
        "(impl=auto takes it while the keys are no more than its 45 features); only the "
        "linear path is compiled: attention.impl=linear forces it",
        "attention.compiled=true: linear runs uncompiled at 8 keys, on its quadratic path "
        "(impl=auto takes it while the keys are no more than its 8 features); only the "
        "linear path is compiled: attention.impl=linear forces it",
    ]


def test_a_step_past_the_recompile_limit_runs_eagerly_and_keeps_compiling(monkeypatch, caplog):
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from transformers_lab.attention.feature_map import steps as steps_module

    def limited(fn, **kw):
        def run(x):
            if x > 10:
                raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")
            return ("compiled", fn(x))

        return run

    monkeypatch.setattr(torch, "compile", limited)
    step = steps_module.compile_step(lambda x: x + 1)
    with caplog.at_level("WARNING"):
        assert step(1) == ("compiled", 2)
        assert step(11) == 12 and step(12) == 13  # eagerly
        assert step(2) == ("compiled", 3)  # the shapes compiled keep their code
    assert step.failed == [] and caplog.text.count("recompile limit") == 1


def test_a_step_that_cannot_compile_runs_eagerly_and_says_so_once(monkeypatch, caplog):
    from transformers_lab.attention.feature_map import steps as steps_module

    def refuse(fn, **kw):
        def broken(*args):
            raise RuntimeError("no C++ compiler here")

        return broken

    monkeypatch.setattr(torch, "compile", refuse)
    calls = []

    def add(x, y):
        calls.append(1)
        return x + y

    step = steps_module.compile_step(add)
    with caplog.at_level("WARNING"):
        assert step(1, 2) == 3 and step(2, 3) == 5
    assert step.failed == ["RuntimeError: no C++ compiler here"]
    assert caplog.text.count("torch.compile of the linear path's add failed") == 1
    # a real error of the step itself is raised, not hidden by the fallback
    with pytest.raises(TypeError):
        steps_module.compile_step(add)(1, "x")
