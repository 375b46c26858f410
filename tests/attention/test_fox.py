"""The Forgetting Transformer's kernel (attention/fox.py): both of its forms against the
explicit weights in float64, at lengths past one block, its cache, and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import build_kernel, fox

B, H, D = 2, 3, 8


def inputs(n, strength, dtype=torch.float64, seed=0, nq=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, nq or n, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, H, n, D, generator=g, dtype=dtype) for _ in range(2))
    log_f = F.logsigmoid(torch.randn(B, H, n, generator=g, dtype=dtype) + 4.0) * strength
    return q, k, v, log_f


def explicit(kernel, q, k, v, log_f, pad=None):
    """o = weights @ v with D_ij = c_i - c_j summed in float64 (``reference_weights``)."""
    return kernel.reference_weights(q, k, causal=True, key_padding_mask=pad, f=log_f) @ v.double()


@pytest.mark.parametrize(
    ("n", "strength", "form"),
    [
        (40, 0.5, "one call"),  # a span of a few units: one SDPA call
        (1100, 10.0, "blocks"),  # a span of hundreds: three blocks of queries, one short
        (700, 2000.0, "blocks"),  # log f near -40 a token: no key but the nearest counts
    ],
)
def test_both_forms_equal_the_explicit_weights_outputs_and_gradients(
    n, strength, form, monkeypatch
):
    kernel = build_kernel("fox", head_dim=D, n_head=H)
    calls = []
    real = kernel._block
    monkeypatch.setattr(kernel, "_block", lambda *a: calls.append(1) or real(*a))
    q, k, v, log_f = (t.requires_grad_() for t in inputs(n, strength))
    got = kernel(q, k, v, causal=True, f=log_f)
    want = explicit(kernel, q, k, v, log_f) if n <= 40 else None
    if want is None:  # (N, N, N) indicators are too big: the explicit weights in float64
        want = kernel.weights(q, k, causal=True, f=log_f) @ v
    torch.testing.assert_close(got, want)
    assert bool(calls) == (form == "blocks")
    probe = torch.randn_like(got)
    leaves = (q, k, v, log_f)
    for a, b in zip(
        torch.autograd.grad((got * probe).sum(), leaves),
        torch.autograd.grad((want * probe).sum(), leaves),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
    # float32: finite, and no further from the float64 result than the explicit weights in
    # float32 are (both carry the rounding of c = cumsum(log f), thousands at log f = -40)
    q32, k32, v32, f32 = (t.detach().float() for t in (q, k, v, log_f))
    got32 = kernel(q32, k32, v32, causal=True, f=f32)
    assert torch.isfinite(got32).all()
    want32 = kernel.weights(q32, k32, causal=True, f=f32) @ v32
    error = (got32.double() - want.detach()).abs().max().item()
    explicit_error = (want32.double() - want.detach()).abs().max().item()
    assert error <= 1.5 * explicit_error + 1e-6, (error, explicit_error)


def test_the_weights_are_the_published_formula():
    """softmax_j(q_i . k_j / sqrt(D) + sum_{l=j+1..i} log f_l), written out for one row."""
    kernel = build_kernel("fox", head_dim=D, n_head=H)
    q, k, v, log_f = inputs(6, 1.0)
    w = kernel.weights(q, k, causal=True, f=log_f)
    i = 4
    s = torch.stack(
        [q[0, 1, i] @ k[0, 1, j] / D**0.5 + log_f[0, 1, j + 1 : i + 1].sum() for j in range(i + 1)]
    )
    torch.testing.assert_close(w[0, 1, i, : i + 1], torch.softmax(s, 0))
    assert (w[0, 1, i, i + 1 :] == 0).all()


def test_a_padded_key_is_not_seen_and_forgets_nothing():
    kernel = build_kernel("fox", head_dim=D, n_head=H)
    q, k, v, log_f = inputs(900, 0.5)
    pad = torch.zeros(B, 900, dtype=torch.bool)
    pad[0, 300:310] = True
    got = kernel(q, k, v, causal=True, key_padding_mask=pad, f=log_f)
    # the same as dropping those tokens from the first sequence
    keep = ~pad[0]
    alone = kernel(
        q[:1, :, keep], k[:1, :, keep], v[:1, :, keep], causal=True, f=log_f[:1, :, keep]
    )
    torch.testing.assert_close(got[:1, :, keep], alone)


def test_decoding_past_a_long_prefix_keeps_the_gate_sum_about_the_last_token():
    """Decode equals forward; the cache's gate sums are 0 at the last token, so they do
    not grow with the tokens decoded, and a trimmed cache keeps its keys' sums."""
    kernel = build_kernel("fox", head_dim=D, n_head=H)
    q, k, v, log_f = inputs(600, 3.0)
    whole = kernel(q, k, v, causal=True, f=log_f)
    out, state = kernel.decode(q[:, :, :590], k[:, :, :590], v[:, :, :590], f=log_f[..., :590])
    steps = [out]
    for t in range(590, 600):
        o, state = kernel.decode(
            *(x[:, :, t : t + 1] for x in (q, k, v)), state, f=log_f[..., t : t + 1]
        )
        steps.append(o)
        assert (state[3][..., -1] == 0).all() and (state[3] >= 0).all()
    torch.testing.assert_close(torch.cat(steps, 2), whole)
    assert kernel.state_size(600, D) == sum(t.numel() for t in state if t is not None) // B
    trimmed = kernel.trim_state(state, 50)
    assert trimmed[0].shape[2] == 50 and trimmed[3].shape[-1] == 50
    torch.testing.assert_close(trimmed[3], state[3][..., -50:])


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (dict(f=torch.full((B, H, 5), 0.5)), "log forget gate must be finite and <= 0"),
        (dict(f=torch.zeros(B, H, 4)), "the gate f must be \\(B, H, Nk=5\\)"),
        (dict(), "fox needs its gate input f"),
    ],
)
def test_bad_gates_are_refused_in_one_line(change, error):
    kernel = build_kernel("fox", head_dim=D, n_head=H)
    q = torch.zeros(B, H, 5, D)
    with pytest.raises(ValueError, match=error):
        kernel(q, q, q, causal=True, **change)


def test_a_non_causal_call_is_refused():
    kernel = build_kernel("fox", head_dim=D, n_head=H)
    q = torch.zeros(B, H, 5, D)
    with pytest.raises(
        ValueError, match="forget gates between query and key, so it is causal only"
    ):
        kernel(q, q, q, causal=False, f=torch.zeros(B, H, 5))


def test_one_call_span_is_a_bound_on_the_rounding():
    """The one-call form's scores carry c - r, |c - r| <= ONE_CALL_SPAN / 2: float32's
    rounding of numbers that wide stays near 1e-5."""
    assert fox.ONE_CALL_SPAN / 2 * torch.finfo(torch.float32).eps < 1e-5
