"""RWKV-7: the kernel held against its step written out token by token from the paper's
formulas (kappa, the shrunk key, the decay's bound, the bonus), in float64 and float32,
outputs and gradients; its layer; bad settings in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import build_kernel
from transformers_lab.nn.multihead import MultiHeadAttention

B, H, D = 2, 3, 8


def goose(kernel, r, k, v, w_in, a):
    """RWKV-7's time mixing, one token at a time, as the paper writes it."""
    s = r.new_zeros(B, H, D, v.shape[-1])
    out = []
    for t in range(r.shape[2]):
        w = torch.exp(-torch.exp(torch.tensor(-0.5)) * torch.sigmoid(w_in[:, :, t] + kernel.w_bias))
        kappa = F.normalize(k[:, :, t] * kernel.k_k, dim=-1)
        key = k[:, :, t] * (1 + (a[:, :, t] - 1) * kernel.k_a)
        removed = (kappa * a[:, :, t])[..., None] * (
            kappa[..., None, :] @ s
        )  # (kappa a)(kappa^T S)
        s = w[..., None] * s - removed + key[..., None] * v[:, :, t, None, :]
        bonus = (r[:, :, t] * key * kernel.r_k).sum(-1, keepdim=True) * v[:, :, t]
        out.append(((r[:, :, t, None, :] @ s).squeeze(-2) + bonus) / D**0.5)  # 1/sqrt(D)
    return torch.stack(out, 2)


def inputs(n, dtype=torch.float64):
    torch.manual_seed(n)
    r, k, v = (torch.randn(B, H, n, D, dtype=dtype) for _ in range(3))
    w_in = torch.randn(B, H, n, D, dtype=dtype)
    a = torch.rand(B, H, n, D, dtype=dtype)
    return r, k, v, w_in, a


def kernel_of(**options):
    torch.manual_seed(0)
    kernel = build_kernel("rwkv7", head_dim=D, n_head=H, **options).double()
    with torch.no_grad():  # off their initial values, so that a dropped one shows
        for p in kernel.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return kernel


@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_the_kernel_is_rwkv7s_step(chunk):
    kernel = kernel_of(chunk_size=chunk)
    r, k, v, w_in, a = inputs(37)
    want = goose(kernel, r, k, v, w_in, a)
    torch.testing.assert_close(kernel(r, k, v, causal=True, w=w_in, a=a), want)
    out, _ = kernel.decode(r, k, v, None, w=w_in, a=a)
    torch.testing.assert_close(out, want)
    weights = kernel.weights(r, k, causal=True, w=w_in, a=a)
    torch.testing.assert_close(weights @ v, want)


def test_float32_and_gradients_follow_float64():
    kernel = kernel_of()
    r, k, v, w_in, a = (t.requires_grad_() for t in inputs(70))
    want = goose(kernel, r, k, v, w_in, a)
    want_grads = torch.autograd.grad(want.square().sum(), (r, k, v, w_in, a))
    single = kernel.float()
    got = single(r.float(), k.float(), v.float(), causal=True, w=w_in.float(), a=a.float())
    got_grads = torch.autograd.grad(got.square().sum(), (r, k, v, w_in, a))
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, atol=1e-3, rtol=1e-3)


def test_its_decay_is_bounded_and_spread_across_a_heads_channels():
    kernel = build_kernel("rwkv7", head_dim=D, n_head=H)
    per_token = -torch.exp(torch.tensor(-0.5)) * torch.sigmoid(kernel.w_bias)
    assert per_token.min() >= -0.61 and per_token.max() < 0
    assert (per_token[:, 0] > -0.01).all() and (per_token[:, -1] < -0.3).all()


def test_the_layer_projects_w_and_a_per_channel_through_bottlenecks():
    layer = MultiHeadAttention(24, 3, "rwkv7")
    gates = layer.gate_values(torch.randn(2, 5, 24))
    assert gates["w"].shape == gates["a"].shape == (2, 3, 5, 8)
    assert ((gates["a"] > 0) & (gates["a"] < 1)).all()
    assert layer.gates.proj["w"][0].out_features == 32  # gate_rank


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_a_bad_gate_rank_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="^rwkv7: gate_rank must be an integer >= 1"):
        build_kernel("rwkv7", head_dim=D, n_head=H, gate_rank=bad)
