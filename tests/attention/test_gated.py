"""The gated recurrence (attention/gated/recurrence.py): decay and the delta rule, chunked,
against the token-by-token recurrence in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import build_kernel
from transformers_lab.attention.gated import recurrence as gated
from transformers_lab.attention.gated.recurrence import (
    chunked_recurrence,
    naive_recurrence,
    unit_lower_inverse,
)

B, H, DK, DV = 2, 3, 5, 4
CASES = {
    "plain": dict(decay=None, delta=False),
    "scalar decay": dict(decay="scalar", delta=False),  # RetNet, simple_gla
    "channel decay": dict(decay="channel", delta=False),  # GLA
    "delta": dict(decay=None, delta=True),  # DeltaNet
    "gated delta": dict(decay="scalar", delta=True),  # Gated DeltaNet
    "channel delta": dict(decay="channel", delta=True),  # KDA
}


def inputs(n, decay, delta, dtype=torch.float64, seed=0, strength=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DK, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, n, DV, generator=g, dtype=dtype)
    log_decay = beta = None
    if decay == "scalar":
        log_decay = -strength * torch.rand(B, H, n, generator=g, dtype=dtype)
    elif decay == "channel":
        log_decay = -strength * torch.rand(B, H, n, DK, generator=g, dtype=dtype)
    if delta:
        k = F.normalize(k, dim=-1)  # as DeltaNet's layer does: keeps the recurrence stable
        beta = torch.rand(B, H, n, generator=g, dtype=dtype)
    return q, k, v, log_decay, beta


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [1, 4, 7, 16, 64])
def test_the_chunked_path_equals_the_recurrence_outputs_gradients_and_state(case, chunk):
    n = 37  # a remainder chunk for every chunk size but 1
    tensors = [t for t in inputs(n, **CASES[case])]
    for t in tensors:
        if t is not None:
            t.requires_grad_()
    state0 = torch.randn(B, H, DK, DV, dtype=torch.float64, requires_grad=True)
    q, k, v, log_decay, beta = tensors
    want, want_s = naive_recurrence(q, k, v, log_decay, beta, state=state0)
    got, got_s = chunked_recurrence(q, k, v, log_decay, beta, state=state0, chunk_size=chunk)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_s, want_s)
    leaves = [t for t in (*tensors, state0) if t is not None]
    probe = torch.randn_like(want)
    want_g = torch.autograd.grad((want * probe).sum() + want_s.sum(), leaves)
    got_g = torch.autograd.grad((got * probe).sum() + got_s.sum(), leaves)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("every", "chunk"), [(2, 4), (2, 7), (3, 16), (3, 64)])
def test_reading_every_mth_step_gives_those_rows_of_the_recurrence(case, every, chunk):
    """``read_every``: the outputs of steps m - 1, 2m - 1, ... alone, whatever the other
    steps' queries hold (Gated DeltaProduct's), their gradients and the state as the full
    recurrence's; a chunk rounds down to a multiple of m."""
    n = 13 * every
    tensors = [t for t in inputs(n, **CASES[case])]
    for t in tensors:
        if t is not None:
            t.requires_grad_()
    q, k, v, log_decay, beta = tensors
    want, want_s = naive_recurrence(q, k, v, log_decay, beta)
    want = want[:, :, every - 1 :: every]
    got, got_s = chunked_recurrence(q, k, v, log_decay, beta, chunk_size=chunk, read_every=every)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_s, want_s)
    leaves = [t for t in tensors if t is not None]
    probe = torch.randn_like(want)
    want_g = torch.autograd.grad((want * probe).sum() + want_s.sum(), leaves)
    got_g = torch.autograd.grad((got * probe).sum() + got_s.sum(), leaves)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="read_every must be >= 1 and divide the"):
        chunked_recurrence(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], read_every=every)


@pytest.mark.parametrize("case", CASES)
def test_gradcheck(case):
    q, k, v, log_decay, beta = inputs(6, **CASES[case])
    leaves = [t.requires_grad_() for t in (q, k, v, log_decay, beta) if t is not None]

    def f(*args):
        it = iter(args)
        q_, k_, v_ = next(it), next(it), next(it)
        ld = next(it) if log_decay is not None else None
        bt = next(it) if beta is not None else None
        return chunked_recurrence(q_, k_, v_, ld, bt, chunk_size=4)[0]

    assert torch.autograd.gradcheck(f, leaves)


@pytest.mark.parametrize("chunk", [16, 64])  # 16: KDA's preset, two blocks of 8 a chunk
@pytest.mark.parametrize("case", ["scalar decay", "channel decay", "gated delta", "channel delta"])
def test_a_strong_decay_does_not_overflow_in_float32(case, chunk):
    """Log decays of -30 a token: the cumulative decay over a chunk of 64 is e^-1920, whose
    inverse overflows float32 (and float64) in the naive factorisation q e^b, k e^-b."""
    n = 128
    q, k, v, log_decay, beta = inputs(n, **CASES[case], strength=30.0)
    want, _ = naive_recurrence(q, k, v, log_decay, beta)
    got, _ = chunked_recurrence(
        *(None if t is None else t.float() for t in (q, k, v, log_decay, beta)), chunk_size=chunk
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["channel decay", "scalar decay", "gated delta", "channel delta"])
@pytest.mark.parametrize("span", [0.0, 60.0])  # 0: no chunk folds; 60: every chunk folds
def test_both_paths_of_a_decay_match_the_recurrence(case, span, monkeypatch):
    """A decay's scores come from one product a chunk, (q exp(b)) . (k exp(-b)), where no
    chunk decays by more than e^-SAFE_SPAN; otherwise by sub-chunk blocks (a decay per
    channel) or through the (C x C) factor exp(b_t - b_s) (one per head and token). Both
    are the recurrence, outputs and gradients, in float64."""
    per_channel = CASES[case]["decay"] == "channel"
    monkeypatch.setattr(gated, "CHANNEL_SPAN" if per_channel else "SAFE_SPAN", span)
    slow = []
    name = "scores_by_blocks" if per_channel else "pair_decay"
    real = getattr(gated, name)
    monkeypatch.setattr(gated, name, lambda *a: slow.append(1) or real(*a))
    q, k, v, log_decay, beta = inputs(45, **CASES[case])
    leaves = [t.requires_grad_() for t in (q, k, v, log_decay, beta) if t is not None]
    want, _ = naive_recurrence(q, k, v, log_decay, beta)
    got, _ = chunked_recurrence(q, k, v, log_decay, beta, chunk_size=32)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), leaves)
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), leaves), strict=True):
        torch.testing.assert_close(g, w)
    assert bool(slow) == (span == 0.0)  # the path the span asks for was taken


def test_a_channel_decay_past_safe_span_still_folds_about_the_chunks_middle(monkeypatch):
    """Chunks of a per-channel decay that span e^-60 to e^-80 (GLA's gates learn such) take
    the one product, about each chunk's middle: in float32 finite and the recurrence."""
    blocks = []
    real = gated.scores_by_blocks
    monkeypatch.setattr(gated, "scores_by_blocks", lambda *a: blocks.append(1) or real(*a))
    q, k, v, _, _ = inputs(64, decay=None, delta=False)
    log_decay = torch.full((B, H, 64, DK), -2.2, dtype=torch.float64)  # -70 a chunk of 32
    want, _ = naive_recurrence(q, k, v, log_decay)
    got, _ = chunked_recurrence(q.float(), k.float(), v.float(), log_decay.float(), chunk_size=32)
    assert not blocks and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    got64, _ = chunked_recurrence(q, k, v, log_decay, chunk_size=32)
    torch.testing.assert_close(got64, want)
    # a span past CHANNEL_SPAN takes the blocks, each block of SUB_CHUNK (8) one product
    # about its middle (8 x 3 = 24 <= CHANNEL_SPAN): the recurrence still, in float32 too
    strong = torch.full_like(log_decay, -3.0)
    want, _ = naive_recurrence(q, k, v, strong)
    got, _ = chunked_recurrence(q.float(), k.float(), v.float(), strong.float(), chunk_size=32)
    assert blocks and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_decoding_token_by_token_from_a_chunked_prefix_equals_the_whole():
    q, k, v, log_decay, beta = inputs(20, decay="scalar", delta=True)
    whole, _ = chunked_recurrence(q, k, v, log_decay, beta, chunk_size=8)
    prefix, state = chunked_recurrence(*(t[:, :, :13] for t in (q, k, v, log_decay, beta)))
    steps = [prefix]
    for t in range(13, 20):
        o, state = naive_recurrence(
            *(x[:, :, t : t + 1] for x in (q, k, v, log_decay, beta)), state=state
        )
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 2), whole)


def test_the_recurrences_are_the_published_formulas():
    """RetNet's retention as its parallel form: o = (Q K^T * D) V, D[t, s] = gamma^(t-s);
    the delta rule's state moves its prediction for k towards v by beta."""
    q, k, v, _, _ = inputs(9, None, False)
    gamma = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float64))
    t = torch.arange(9, dtype=torch.float64)
    d = gamma[:, None, None] ** (t[:, None] - t[None, :]).clamp(min=0) * (t[:, None] >= t)
    want = ((q * DK**-0.5) @ k.mT * d) @ v
    log_decay = gamma.log()[None, :, None].expand(B, H, 9)
    torch.testing.assert_close(chunked_recurrence(q, k, v, log_decay, chunk_size=4)[0], want)

    k1 = F.normalize(torch.randn(1, 1, 1, DK, dtype=torch.float64), dim=-1)
    v1 = torch.randn(1, 1, 1, DV, dtype=torch.float64)
    s0 = torch.randn(1, 1, DK, DV, dtype=torch.float64)
    _, s1 = naive_recurrence(k1, k1, v1, beta=torch.full((1, 1, 1), 0.25), state=s0)
    before, after = k1[0, 0, 0] @ s0[0, 0], k1[0, 0, 0] @ s1[0, 0]
    torch.testing.assert_close(after - before, 0.25 * (v1[0, 0, 0] - before))


def test_retnet_takes_one_decay_for_every_head_or_one_per_head():
    def gammas(**options):
        return build_kernel("retnet", head_dim=8, n_head=3, **options).log_gamma.exp()

    torch.testing.assert_close(gammas(gamma=0.9), torch.full((3,), 0.9))
    torch.testing.assert_close(gammas(gamma=[0.5, 0.9, 1]), torch.tensor([0.5, 0.9, 1.0]))
    torch.testing.assert_close(gammas(), 1 - 2.0 ** (-5 - torch.arange(3.0)))
    for bad in (0, 1.5, True, "0.9", [0.9, 0.9]):
        with pytest.raises(ValueError, match="gamma must be one decay in \\(0, 1\\]"):
            gammas(gamma=bad)


def test_the_unit_lower_inverse_is_the_inverse():
    a = torch.randn(3, 19, 19, dtype=torch.float64).tril(-1)
    eye = torch.eye(19, dtype=torch.float64)
    torch.testing.assert_close(unit_lower_inverse(a), torch.linalg.inv(eye + a))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (dict(v=torch.zeros(B, H, 5, DV)), "q and k must be \\(B, H, N, Dk\\)"),
        (dict(log_decay=torch.zeros(B, H, 5)), "the log-decay must be \\(B, H, N\\)"),
        (dict(beta=torch.zeros(B, H, 6, 1)), "beta must be \\(B, H, N\\)"),
        # a decay outside (0, 1]: alpha passed where log(alpha) belongs, or a log of 0
        (dict(log_decay=torch.full((B, H, 6), 0.5)), "must be finite and <= 0 .*got 0.5"),
        (dict(log_decay=torch.full((B, H, 6), -float("inf"))), "must be finite and <= 0"),
    ],
)
def test_bad_shapes_are_refused_in_one_line(change, error):
    args = dict(q=torch.zeros(B, H, 6, DK), k=torch.zeros(B, H, 6, DK), v=torch.zeros(B, H, 6, DV))
    args.update(change)
    with pytest.raises(ValueError, match=error):
        chunked_recurrence(**args)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "gla", "kda"])
def test_the_explicit_weights_give_the_forward_at_a_real_length(name):
    """``weights @ v == forward`` in float32 at N=320, where inverting (I + A) by a power
    series over the whole sequence blew up (the analysis tools draw these maps)."""
    kernel = build_kernel(name, head_dim=16, n_head=2)
    q, k, v = (torch.randn(1, 2, 320, 16) for _ in range(3))
    k = F.normalize(F.silu(k), dim=-1)  # as the delta rule's layer gives its keys
    gates = kernel.sample_gates(1, 320)
    with torch.no_grad():
        out = kernel(q, k, v, causal=True, **gates)
        weights = kernel.weights(q, k, causal=True, **gates)
    torch.testing.assert_close(weights @ v, out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["channel decay", "gated delta", "channel delta"])
def test_the_public_op_runs_in_half_precision(case):
    """float16 in, float16 out, finite: the one-product path of a channel decay would
    overflow there (e^60), and the triangular solve has no half-precision kernel."""
    q, k, v, log_decay, beta = inputs(70, **CASES[case], dtype=torch.float32, strength=0.5)
    want, _ = chunked_recurrence(q, k, v, log_decay, beta, chunk_size=32)
    half = (None if t is None else t.half() for t in (q, k, v, log_decay, beta))
    got, _ = chunked_recurrence(*half, chunk_size=32)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
