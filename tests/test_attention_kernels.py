"""Every kernel against its formula written naively, and against the kernel contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import (
    KERNELS,
    AdditiveAttention,
    AttentionKernel,
    CosineAttention,
    FastmaxAttention,
    build_kernel,
)

B, H, D = 2, 3, 8
NAMES = sorted(KERNELS)
KERNEL_CONFIGS = [
    ("softmax", {}),
    ("dot", {}),
    ("cosine", {}),
    ("additive", {}),
    ("additive", {"attn_dim": 5, "bias": False}),
    ("fastmax", {"p": 1, "impl": "linear"}),
    ("fastmax", {"p": 2, "impl": "linear"}),
    ("fastmax", {"p": 2, "scale": 2.5, "normalize": False, "chunk_size": 3, "impl": "linear"}),
    ("fastmax", {"p": 2, "impl": "quadratic"}),
    ("fastmax", {"p": 2}),  # auto: quadratic for these short sequences
]
CONFIG_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in KERNEL_CONFIGS]


def make(name: str, dtype: torch.dtype = torch.float64, **options) -> AttentionKernel:
    kernel = build_kernel(name, head_dim=D, num_heads=H, **options).to(dtype)
    with torch.no_grad():  # move learned parameters off their init, so tests see them
        for p in kernel.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return kernel.eval()


def qkv(nq: int, nk: int, dtype=torch.float64, dv: int = D, requires_grad: bool = False):
    q = torch.randn(B, H, nq, D, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, H, nk, D, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, H, nk, dv, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def padding(nk: int) -> torch.Tensor:
    """Batch 0 unpadded, batch 1 with its last two keys padded."""
    mask = torch.zeros(B, nk, dtype=torch.bool)
    mask[1, -2:] = True
    return mask


def naive_scores(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Each kernel's score (or, for fastmax, the positive weight), by its textbook formula,
    in float64, one (query, key) pair of loops at a time where it is cheap enough."""
    q, k = q.double(), k.double()
    if kernel.name in ("softmax", "dot"):
        return torch.einsum("bhid,bhjd->bhij", q, k) * kernel.scale
    if kernel.name == "cosine":
        cos = torch.einsum("bhid,bhjd->bhij", q, k)
        cos = cos / (q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :])
        tau = torch.exp(torch.clamp(kernel.log_tau.double(), max=math.log(100.0)))
        return tau * cos
    if kernel.name == "additive":
        wq, wk, w = kernel.w_q.double(), kernel.w_k.double(), kernel.w.double()
        pre = torch.einsum("bhid,hda->bhia", q, wq)[:, :, :, None, :]
        pre = pre + torch.einsum("bhjd,hda->bhja", k, wk)[:, :, None, :, :]
        if kernel.b is not None:
            pre = pre + kernel.b.double()[None, :, None, None, :]
        return torch.einsum("bhija,ha->bhij", torch.tanh(pre), w)
    raise AssertionError(kernel.name)


def naive_weights(kernel, q, k, causal, key_padding_mask):
    nq, nk = q.shape[2], k.shape[2]
    allowed = torch.ones(B, 1, nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            if causal and j > i + (nk - nq):
                allowed[:, :, i, j] = False
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, None, :]
    if kernel.name == "fastmax":
        qd, kd = q.double(), k.double()
        if kernel.normalize:
            qd = qd / qd.norm(dim=-1, keepdim=True)
            kd = kd / kd.norm(dim=-1, keepdim=True)
        x = kernel.scale * torch.einsum("bhid,bhjd->bhij", qd, kd)
        f = sum(x**m / math.factorial(m) for m in range(kernel.p + 1))
    else:
        s = naive_scores(kernel, q, k)
        f = torch.exp(s - s.amax(dim=-1, keepdim=True))
    f = torch.where(allowed, f, torch.zeros_like(f))
    den = f.sum(dim=-1, keepdim=True)
    return torch.where(den > 0, f / den, torch.zeros_like(f))


SHAPES = [(7, 7), (3, 9), (9, 4)]


@pytest.mark.parametrize(("name", "options"), KERNEL_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("nq", "nk"), SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_forward_matches_naive_formula(name, options, causal, nq, nk, padded):
    kernel = make(name, **options)
    q, k, v = qkv(nq, nk, dv=5)
    mask = padding(nk) if padded else None
    expected = naive_weights(kernel, q, k, causal, mask) @ v
    out = kernel(q, k, v, causal=causal, key_padding_mask=mask)
    assert out.shape == (B, H, nq, 5)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)

    # float32 within 1e-5 relative of the float64 formula
    kernel32 = kernel.float()
    out32 = kernel32(q.float(), k.float(), v.float(), causal=causal, key_padding_mask=mask)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "options"), KERNEL_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_weights_rows_sum_to_one_and_forward_is_weights_at_v(name, options, causal):
    kernel = make(name, **options)
    q, k, v = qkv(6, 10)
    mask = padding(10)
    w = kernel.weights(q, k, causal=causal, key_padding_mask=mask)
    assert w.shape == (B, H, 6, 10)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, 6, dtype=w.dtype))
    assert (w >= 0).all()
    assert (w[1, :, :, -2:] == 0).all(), "padded keys must get zero weight"
    out = kernel(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out, w @ v)


@pytest.mark.parametrize(("name", "options"), KERNEL_CONFIGS, ids=CONFIG_IDS)
def test_causal_outputs_ignore_the_future(name, options):
    kernel = make(name, **options)
    q, k, v = qkv(10, 10)
    out = kernel(q, k, v, causal=True)
    i = 4
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[:, :, i + 1 :] = 100 * torch.randn_like(t[:, :, i + 1 :])
    out2 = kernel(q2, k2, v2, causal=True)
    torch.testing.assert_close(out2[:, :, : i + 1], out[:, :, : i + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(out2[:, :, i + 1 :], out[:, :, i + 1 :])


@pytest.mark.parametrize(("name", "options"), KERNEL_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_change_nothing(name, options, causal):
    kernel = make(name, **options)
    q, k, v = qkv(5, 8)
    mask = padding(8)
    out = kernel(q, k, v, causal=causal, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, -2:] = 1e3 * torch.randn_like(k2[1, :, -2:])
    v2[1, :, -2:] = 1e3 * torch.randn_like(v2[1, :, -2:])
    out2 = kernel(q, k2, v2, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("name", "options"), KERNEL_CONFIGS, ids=CONFIG_IDS)
def test_fully_masked_query_gives_zeros_and_finite_gradients(name, options):
    kernel = make(name, **options)
    q, k, v = qkv(4, 4, requires_grad=True)
    mask = torch.zeros(B, 4, dtype=torch.bool)
    mask[1] = True  # every key of batch 1 is padding
    # causal with Nq > Nk also leaves the first queries with no key
    for out in (
        kernel(q, k, v, key_padding_mask=mask),
        kernel(q, k[:, :, :2], v[:, :, :2], causal=True),
    ):
        assert torch.isfinite(out).all()
        out.sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
    assert (kernel(q, k, v, key_padding_mask=mask)[1] == 0).all()
    assert (kernel(q, k[:, :, :2], v[:, :, :2], causal=True)[:, :, :2] == 0).all()
    assert (kernel.weights(q, k, key_padding_mask=mask)[1] == 0).all()


@pytest.mark.parametrize(("name", "options"), KERNEL_CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(name, options, causal):
    kernel = make(name, **options)
    q, k, v = qkv(4, 5, requires_grad=True)
    q, k, v = (t.detach()[:1, :, :, :].requires_grad_() for t in (q, k, v))
    mask = torch.tensor([[False, False, False, False, True]])

    def fn(q, k, v):
        return kernel(q, k, v, causal=causal, key_padding_mask=mask)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)


def test_softmax_equals_sdpa():
    kernel = make("softmax")
    q, k, v = qkv(6, 9)
    torch.testing.assert_close(kernel(q, k, v), F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(
        kernel(q, k[:, :, :6], v[:, :, :6], causal=True),
        F.scaled_dot_product_attention(q, k[:, :, :6], v[:, :, :6], is_causal=True),
    )
    mask = padding(9)
    torch.testing.assert_close(
        kernel(q, k, v, key_padding_mask=mask),
        F.scaled_dot_product_attention(q, k, v, attn_mask=~mask[:, None, None, :]),
    )


def test_cosine_temperature_initial_value_and_clamp():
    kernel = CosineAttention(head_dim=D, num_heads=H)
    torch.testing.assert_close(kernel.tau(), torch.full((H, 1, 1), 10.0))
    with torch.no_grad():
        kernel.log_tau.fill_(20.0)
    torch.testing.assert_close(kernel.tau(), torch.full((H, 1, 1), 100.0))
    assert kernel.log_tau.shape == (H, 1, 1)


def test_additive_parameters_are_sized_by_head_dim():
    kernel = AdditiveAttention(head_dim=D, num_heads=H, attn_dim=6)
    assert kernel.w_q.shape == (H, D, 6) and kernel.w_k.shape == (H, D, 6)
    assert kernel.w.shape == (H, 6) and kernel.b.shape == (H, 6)
    assert AdditiveAttention(head_dim=D, num_heads=H).w.shape == (H, D)


def test_additive_chunks_respect_the_budget_and_change_nothing():
    big = make("additive", memory_budget_mb=1024.0)
    small = make("additive", memory_budget_mb=1e-3)
    small.load_state_dict(big.state_dict())
    q, k, v = qkv(11, 13, requires_grad=True)
    assert big.chunk_rows(B, 13, torch.float64) >= 11  # one chunk
    assert small.chunk_rows(B, 13, torch.float64) == 1  # eleven chunks
    # a budget of several rows: the chunk is the most rows that fit
    per_row = 2 * B * H * 13 * big.attn_dim * 8  # bytes of one query row: 2 live copies
    mid = make("additive", memory_budget_mb=3.5 * per_row / 2**20)
    assert mid.chunk_rows(B, 13, torch.float64) == 3
    out_big = big(q, k, v, causal=True)
    (gq_big,) = torch.autograd.grad(out_big.sum(), q)
    out_small = small(q, k, v, causal=True)
    (gq_small,) = torch.autograd.grad(out_small.sum(), q)
    torch.testing.assert_close(out_small, out_big)
    torch.testing.assert_close(gq_small, gq_big)


@pytest.mark.parametrize("bias", [True, False])
def test_additive_gradients_of_inputs_and_parameters_match_the_formula(bias):
    # the chunks' hand-written backward against autograd through the textbook formula,
    # over several chunks (a tiny budget) and with padding
    kernel = make("additive", memory_budget_mb=1e-3, bias=bias)
    q, k, v = qkv(5, 6, requires_grad=True)
    mask = padding(6)
    params = list(kernel.parameters())
    out = kernel(q, k, v, causal=True, key_padding_mask=mask)
    reference = naive_weights(kernel, q, k, True, mask) @ v
    torch.testing.assert_close(out, reference)
    weights = torch.randn_like(out)  # a loss that weighs every output differently
    got = torch.autograd.grad((out * weights).sum(), [q, k, v, *params])
    want = torch.autograd.grad((reference * weights).sum(), [q, k, v, *params])
    names = ["q", "k", "v", *dict(kernel.named_parameters())]
    for name, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("name", ["softmax", "dot", "cosine", "additive", "fastmax"])
def test_dropout_acts_in_training_only(name):
    kernel = make(name, dropout=0.5)
    q, k, v = qkv(6, 6)
    eval_out = kernel(q, k, v)
    torch.testing.assert_close(kernel(q, k, v), eval_out)
    kernel.train()
    assert not torch.allclose(kernel(q, k, v), eval_out)


def test_fastmax_dropout_drops_whole_keys_identically_in_every_path():
    linear = make("fastmax", dropout=0.3, impl="linear").train()
    quad = make("fastmax", dropout=0.3, impl="quadratic").train()
    q, k, v = qkv(7, 7)
    for causal in (False, True):
        torch.manual_seed(1)
        a = linear(q, k, v, causal=causal)
        torch.manual_seed(1)
        b = quad(q, k, v, causal=causal)
        torch.testing.assert_close(a, b)
        # the same draw, written out: kept keys scaled by 1/(1-p), normaliser untouched
        torch.manual_seed(1)
        keep = (torch.rand(B, H, 7, 1) >= 0.3).double() / 0.7
        w = linear.weights(q, k, causal=causal)
        torch.testing.assert_close(a, w @ (v * keep))


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_decode_equals_full_causal_forward(name):
    kernel = make(name)
    q, k, v = qkv(9, 9)
    full = kernel(q, k, v, causal=True)
    state, outs = None, []
    for start, stop in ((0, 4), (4, 5), (5, 6), (6, 9)):  # a prefill, then steps
        out, state = kernel.decode(
            q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], state
        )
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), full)


# ---------------------------------------------------------------- bad input


def test_unknown_kernel_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'.*softmax.*fastmax"):
        build_kernel("flash", head_dim=D, num_heads=H)


def test_mismatched_head_dims_are_named():
    kernel = make("softmax")
    q, k, v = qkv(4, 4)
    with pytest.raises(ValueError, match="query head dim 8 != key head dim 6"):
        kernel(q, k[..., :6], v)
    with pytest.raises(ValueError, match="built for head_dim=8"):
        kernel(q[..., :6], k[..., :6], v)
    with pytest.raises(ValueError, match="v of shape"):
        kernel(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="must be 4-D"):
        kernel(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="got no keys"):
        kernel(q, k[:, :, :0], v[:, :, :0])


@pytest.mark.parametrize("name", NAMES)
def test_mask_of_wrong_shape_or_dtype_is_refused(name):
    kernel = make(name)
    q, k, v = qkv(4, 5)
    with pytest.raises(ValueError, match=r"must have shape \(batch, keys\) = \(2, 5\)"):
        kernel(q, k, v, key_padding_mask=torch.zeros(B, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be a bool tensor"):
        kernel(q, k, v, key_padding_mask=torch.zeros(B, 5))


def test_unsupported_p_and_negative_p1_are_refused():
    with pytest.raises(
        ValueError, match=r"unsupported Taylor order p=3; supported orders are \(1, 2\)"
    ):
        FastmaxAttention(head_dim=D, num_heads=H, p=3)
    with pytest.raises(ValueError, match="p=1 gives negative attention weights"):
        FastmaxAttention(head_dim=D, num_heads=H, p=1, normalize=False)
    with pytest.raises(ValueError, match="p=1 gives negative attention weights"):
        FastmaxAttention(head_dim=D, num_heads=H, p=1, scale=2.0)
    with pytest.raises(ValueError, match="unknown impl"):
        FastmaxAttention(head_dim=D, num_heads=H, impl="cuda")


@pytest.mark.parametrize("p", [1, 2])
def test_fastmax_auto_takes_the_cheaper_exact_path(p, monkeypatch):
    from transformers_lab.attention import fastmax as fm

    kernel = make("fastmax", p=p)  # impl=auto
    dim = fm.feature_dim(D, p)
    assert kernel.path(dim) == "quadratic" and kernel.path(dim + 1) == "linear"
    taken = []
    for name in ("quadratic", "chunked_causal"):
        real = getattr(fm, name)
        monkeypatch.setattr(fm, name, lambda *a, _f=real, _n=name: taken.append(_n) or _f(*a))
    linear = make("fastmax", p=p, impl="linear")
    for n in (dim, dim + 1):
        q, k, v = qkv(n, n)
        torch.testing.assert_close(kernel(q, k, v, causal=True), linear(q, k, v, causal=True))
    assert taken == ["quadratic", "chunked_causal", "chunked_causal", "chunked_causal"]


def test_fastmax_p1_weights_are_never_negative():
    kernel = make("fastmax", p=1)
    q, k, _ = qkv(16, 16)
    k[:, :, 3] = -q[:, :, 0]  # an antipodal pair: the extreme score -1
    assert (kernel.weights(q, k) >= 0).all()
