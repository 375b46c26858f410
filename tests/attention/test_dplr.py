"""The DPLR recurrence (attention/gated/dplr.py), RWKV-7's: chunked against token by token
in float64, outputs, gradients and states; the published step written out; bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention.gated.dplr import chunked_dplr, naive_dplr

B, H, DK, DV = 2, 3, 6, 4


def rwkv7_inputs(n, dtype=torch.float64, seed=0, strength=0.6065):
    """RWKV-7's: alpha = -kappa, beta = kappa * a, kappa a unit key, a in (0, 1), its log
    decay in [-strength, 0]."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DK, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, n, DV, generator=g, dtype=dtype)
    log_decay = -strength * torch.rand(B, H, n, DK, generator=g, dtype=dtype)
    kappa = F.normalize(torch.randn(B, H, n, DK, generator=g, dtype=dtype), dim=-1)
    a = torch.rand(B, H, n, DK, generator=g, dtype=dtype)
    return q, k, v, log_decay, -kappa, kappa * a


@pytest.mark.parametrize("chunk", [1, 4, 7, 16, 64])
def test_the_chunked_path_equals_the_recurrence_outputs_gradients_and_state(chunk):
    tensors = [t.requires_grad_() for t in rwkv7_inputs(37)]
    state0 = torch.randn(B, H, DK, DV, dtype=torch.float64, requires_grad=True)
    want, want_s = naive_dplr(*tensors, state=state0, scale=0.5)
    got, got_s = chunked_dplr(*tensors, state=state0, scale=0.5, chunk_size=chunk)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_s, want_s)
    leaves = [*tensors, state0]
    probe = torch.randn_like(want)
    want_g = torch.autograd.grad((want * probe).sum() + want_s.sum(), leaves)
    got_g = torch.autograd.grad((got * probe).sum() + got_s.sum(), leaves)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b)


def test_strong_decays_go_by_blocks_and_stay_exact_in_float32():
    """A decay of e^-30 a token spans far past the one product's e^-80 in a chunk of 64:
    the scores go by blocks; float32 against the float64 recurrence."""
    q, k, v, w, alpha, beta = rwkv7_inputs(80, strength=30.0)
    want, _ = naive_dplr(q, k, v, w, alpha, beta)
    low = (t.float() for t in (q, k, v, w, alpha, beta))
    got, _ = chunked_dplr(*low, chunk_size=64)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_a_step_is_the_published_transition():
    """S_t = Diag(e^w) S + beta (alpha^T S) + k v^T, read by q: the low-rank part reads
    the state before the token, undecayed."""
    q, k, v, w, alpha, beta = rwkv7_inputs(1)
    s0 = torch.randn(B, H, DK, DV, dtype=torch.float64)
    o, s1 = naive_dplr(q, k, v, w, alpha, beta, state=s0)
    step = (
        torch.diag_embed(w[:, :, 0].exp()) @ s0
        + beta[:, :, 0, :, None] * (alpha[:, :, 0, None, :] @ s0)
        + k[:, :, 0, :, None] * v[:, :, 0, None, :]
    )
    torch.testing.assert_close(s1, step)
    torch.testing.assert_close(o[:, :, 0], (q[:, :, 0, None, :] @ step).squeeze(-2))


def test_decoding_in_pieces_from_a_chunked_prefix_equals_the_whole():
    q, k, v, w, alpha, beta = rwkv7_inputs(30)
    whole, _ = chunked_dplr(q, k, v, w, alpha, beta, chunk_size=8)
    _, state = chunked_dplr(*(t[:, :, :20] for t in (q, k, v, w, alpha, beta)), chunk_size=8)
    rest, _ = naive_dplr(*(t[:, :, 20:] for t in (q, k, v, w, alpha, beta)), state=state)
    torch.testing.assert_close(rest, whole[:, :, 20:])


@pytest.mark.parametrize(
    ("index", "value", "error"),
    [
        (3, torch.full((B, H, 5, DK), 0.5), "the log-decay must be in \\[-40, 0\\].*got 0.5"),
        (3, torch.full((B, H, 5, DK), -50.0), "the log-decay must be in \\[-40, 0\\]"),
        (4, torch.zeros(B, H, 5, 1), "alpha must be \\(B, H, N, Dk\\)"),
        (2, torch.zeros(B, H, 4, DV), "q and k must be \\(B, H, N, Dk\\)"),
    ],
)
def test_bad_inputs_are_refused_in_one_line(index, value, error):
    args = list(rwkv7_inputs(5))
    args[index] = value
    with pytest.raises(ValueError, match=error):
        chunked_dplr(*args)
