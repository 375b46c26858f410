"""Gated DeltaProduct: n_h delta-rule steps a token, held against its published recurrence
written out token by token (the decay, then n_h generalised Householder steps, then the
read), in float64; n_h = 1 is Gated DeltaNet; the layer hands it each token's n_h keys in
fla's layout; bad settings are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import build_kernel
from transformers_lab.nn.multihead import MultiHeadAttention

B, H, D, DV = 2, 3, 8, 5


def delta_product(q, k, v, log_alpha, beta, scale, state=None):
    """The recurrence as the paper writes it, one token at a time: S = alpha S, then for
    each of the token's keys S = S - beta k (k^T S) + beta k v^T, then o = S^T q scale.
    q (B, H, N, D), k (B, H, N, n, D), v (B, H, N, n, Dv), log_alpha (B, H, N),
    beta (B, H, N, n)."""
    b, h, n, d = q.shape
    s = q.new_zeros(b, h, d, v.shape[-1]) if state is None else state
    out = []
    for t in range(n):
        s = s * log_alpha[:, :, t, None, None].exp()
        for j in range(k.shape[3]):
            kj, vj, bj = k[:, :, t, j], v[:, :, t, j], beta[:, :, t, j, None, None]
            s = (
                s
                - bj * kj[..., None] * (kj[..., None, :] @ s)
                + bj * kj[..., None] * vj[..., None, :]
            )
        out.append((scale * q[:, :, t, :, None] * s).sum(-2))
    return torch.stack(out, 2), s


def gdp_inputs(n_h: int, n: int, dtype=torch.float64):
    torch.manual_seed(n_h * 100 + n)
    q = torch.randn(B, H, n, D, dtype=dtype)
    k = F.normalize(torch.randn(B, H, n * n_h, D, dtype=dtype), dim=-1)
    v = torch.randn(B, H, n * n_h, DV, dtype=dtype)
    gates = {"beta": torch.rand(B, H, n * n_h, dtype=dtype), "a": torch.randn(B, H, n, dtype=dtype)}
    return q, k, v, gates


def expected(kernel, q, k, v, gates):
    n_h, n = kernel.householder, q.shape[2]
    log_alpha = -kernel.A_log.exp()[:, None] * F.softplus(gates["a"] + kernel.dt_bias[:, None])
    beta = gates["beta"] * (2 if kernel.negative_eigenvalues else 1)
    return delta_product(
        q, k.unflatten(2, (n, n_h)), v.unflatten(2, (n, n_h)), log_alpha.to(q),
        beta.unflatten(2, (n, n_h)), kernel.scale,
    )  # fmt: skip


@pytest.mark.parametrize("n_h", [1, 2, 3])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_the_kernel_is_the_published_recurrence(n_h, chunk):
    kernel = build_kernel(
        "gated_deltaproduct", head_dim=D, n_head=H, householder=n_h, chunk_size=chunk
    ).double()
    q, k, v, gates = gdp_inputs(n_h, 23)
    want, state = expected(kernel, q, k, v, gates)
    torch.testing.assert_close(kernel(q, k, v, causal=True, **gates), want)
    out, decoded = kernel.decode(q, k, v, None, **gates)  # the chunked path, from no state
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(decoded, state)
    weights = kernel.weights(q, k, causal=True, **gates)  # (Nq, n_h N): forward's matrix
    assert weights.shape == (B, H, 23, 23 * n_h)
    torch.testing.assert_close(weights @ v, want)


def test_float32_and_gradients_follow_the_float64_recurrence():
    kernel = build_kernel("gated_deltaproduct", head_dim=D, n_head=H, chunk_size=16).double()
    q, k, v, gates = gdp_inputs(2, 70)
    leaves = [t.requires_grad_() for t in (q, k, v, *gates.values())]
    want, _ = expected(kernel, q, k, v, gates)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    single = kernel.float()
    got = single(*(t.float() for t in (q, k, v)), causal=True,
                 **{name: g.float() for name, g in gates.items()})  # fmt: skip
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, atol=1e-3, rtol=1e-3)


def test_one_step_a_token_without_negative_eigenvalues_is_gated_deltanet():
    torch.manual_seed(0)
    gdp = build_kernel(
        "gated_deltaproduct", head_dim=D, n_head=H, householder=1, negative_eigenvalues=False
    ).double()
    gdn = build_kernel("gated_deltanet", head_dim=D, n_head=H).double()
    gdn.load_state_dict(gdp.state_dict())
    q, k, v, gates = gdp_inputs(1, 30)
    torch.testing.assert_close(
        gdp(q, k, v, causal=True, **gates), gdn(q, k, v, causal=True, **gates)
    )


def test_negative_eigenvalues_double_the_rate():
    """With beta = 2 a unit key's step reflects the state: k^T S -> 2 v - k^T S, which
    (0, 1)'s rates cannot do."""
    kernel = build_kernel("gated_deltaproduct", head_dim=D, n_head=1, householder=1).double()
    with torch.no_grad():
        kernel.A_log.fill_(-30.0)  # no decay
    k = F.normalize(torch.randn(1, 1, 1, D, dtype=torch.float64), dim=-1)
    v = torch.randn(1, 1, 1, DV, dtype=torch.float64)
    s0 = torch.randn(1, 1, D, DV, dtype=torch.float64)
    gates = {
        "beta": torch.ones(1, 1, 1, dtype=torch.float64),
        "a": torch.zeros(1, 1, 1, dtype=torch.float64),
    }
    _, s1 = kernel.decode(k, k, v, s0, **gates)
    before, after = k[0, 0, 0] @ s0[0, 0], k[0, 0, 0] @ s1[0, 0]
    torch.testing.assert_close(after, 2 * v[0, 0, 0] - before, atol=1e-9, rtol=1e-9)


def test_the_layer_hands_each_token_its_keys_in_flas_layout():
    """k and v come from one projection n_h times as wide, laid out (n_h, H, D) a token
    (fla's ``(n h d)``); each of a token's keys is L2-normalised; beta is one a key."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(24, 3, "gated_deltaproduct")  # the bare kernel: no parts
    x = torch.randn(2, 5, 24)
    q, k, v = layer.project(x, None)
    assert q.shape == (2, 3, 5, 8) and k.shape == (2, 3, 10, 8) and v.shape == (2, 3, 10, 8)
    qkv = layer.qkv_proj(x)
    keys = qkv[..., 24:72].view(2, 5, 2, 3, 8)  # (B, N, n_h, H, D)
    values = qkv[..., 72:].view(2, 5, 2, 3, 8)
    torch.testing.assert_close(k[:, 1, 2 * 4 + 1], keys[:, 4, 1, 1])  # token 4, step 1, head 1
    torch.testing.assert_close(v[:, 2, 2 * 3 + 0], values[:, 3, 0, 2])
    assert layer.gate_values(x)["beta"].shape == (2, 3, 10)
    assert layer.gate_values(x)["a"].shape == (2, 3, 5)
    assert layer(x, causal=True).shape == (2, 5, 24)


def test_rope_turns_each_of_a_tokens_keys_by_the_tokens_position():
    torch.manual_seed(0)
    plain = MultiHeadAttention(24, 3, "gated_deltaproduct")
    roped = MultiHeadAttention(24, 3, "gated_deltaproduct", rope_theta=100.0)
    roped.load_state_dict(plain.state_dict())
    x = torch.randn(1, 6, 24)
    _, k, _ = plain.project(x, None)
    _, k_rot, _ = roped.project(x, None)
    steps = k.unflatten(2, (6, 2))  # (B, H, N, n_h, D)
    for j in range(2):  # each step's keys, rotated as a sequence of the tokens' positions
        torch.testing.assert_close(
            k_rot.unflatten(2, (6, 2))[:, :, :, j], roped.rotary(steps[:, :, :, j])
        )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_number_of_steps_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="householder must be an integer >= 1") as info:
        build_kernel("gated_deltaproduct", head_dim=D, n_head=H, householder=bad)
    assert "\n" not in str(info.value)


def test_keys_not_a_multiple_of_the_steps_are_refused_in_one_line():
    kernel = build_kernel("gated_deltaproduct", head_dim=D, n_head=H)
    q, k, v, gates = gdp_inputs(2, 5, torch.float32)
    with pytest.raises(ValueError, match="takes 2 keys a token"):
        kernel(q, k[:, :, 1:], v[:, :, 1:], causal=True, **gates)
