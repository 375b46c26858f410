"""Multi-head attention around the kernels."""

from __future__ import annotations

import functools

import pytest
import torch

from transformers_lab.attention import (
    KERNELS,
    AttentionKernel,
    FastmaxAttention,
    SoftmaxAttention,
    call_with_heads,
    contract,
    masked_softmax,
)
from transformers_lab.attention.masks import attention_mask
from transformers_lab.models.gpt import GPT
from transformers_lab.nn import MultiHeadAttention

D_MODEL, HEADS = 16, 4


def copy_from_torch(ours: MultiHeadAttention, ref: torch.nn.MultiheadAttention) -> None:
    with torch.no_grad():
        if ours.cross:
            ours.q_proj.weight.copy_(ref.in_proj_weight[:D_MODEL])
            ours.q_proj.bias.copy_(ref.in_proj_bias[:D_MODEL])
            ours.kv_proj.weight.copy_(ref.in_proj_weight[D_MODEL:])
            ours.kv_proj.bias.copy_(ref.in_proj_bias[D_MODEL:])
        else:
            ours.qkv_proj.weight.copy_(ref.in_proj_weight)
            ours.qkv_proj.bias.copy_(ref.in_proj_bias)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_matches_torch_multihead_attention(causal):
    ref = torch.nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).double().eval()
    ours = MultiHeadAttention(D_MODEL, HEADS, "softmax").double().eval()
    copy_from_torch(ours, ref)
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    attn_mask = torch.ones(9, 9, dtype=torch.bool).triu(1) if causal else None
    expected, expected_w = ref(
        x, x, x, key_padding_mask=pad, attn_mask=attn_mask, average_attn_weights=False
    )
    torch.testing.assert_close(ours(x, causal=causal, key_padding_mask=pad), expected)
    torch.testing.assert_close(
        ours.attention_weights(x, causal=causal, key_padding_mask=pad), expected_w
    )


def test_cross_attention_matches_torch_multihead_attention():
    ref = torch.nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).double().eval()
    ours = MultiHeadAttention(D_MODEL, HEADS, "softmax", cross=True).double().eval()
    copy_from_torch(ours, ref)
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    mem = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[0, 8:] = True
    expected, _ = ref(x, mem, mem, key_padding_mask=pad)
    torch.testing.assert_close(ours(x, mem, key_padding_mask=pad), expected)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_runs_in_self_and_cross_attention(name):
    layer = MultiHeadAttention(D_MODEL, HEADS, name)
    if getattr(KERNELS[name], "positional", False):  # cosformer: positions of one sequence
        with pytest.raises(ValueError, match="weighs keys by their positions"):
            MultiHeadAttention(D_MODEL, HEADS, name, cross=True, context_dim=12)
        return
    x, mem = torch.randn(2, 7, D_MODEL), torch.randn(2, 3, 12)
    out = layer(x, causal=True)
    out.sum().backward()
    assert out.shape == x.shape
    if KERNELS[name].causal_only:  # a state read in order: no cross-attention, no both ways
        with pytest.raises(ValueError, match="causal only"):
            MultiHeadAttention(D_MODEL, HEADS, name, cross=True, context_dim=12)
        with pytest.raises(ValueError, match="causal only"):
            layer(x, causal=False)
        return
    cross = MultiHeadAttention(D_MODEL, HEADS, name, cross=True, context_dim=12)
    assert cross(x, mem).shape == x.shape
    assert layer.kernel.head_dim == D_MODEL // HEADS and layer.kernel.n_head == HEADS


def test_a_kernel_with_its_own_qk_width_gets_queries_and_keys_of_it():
    """Based declares qk_dim = feature_dim: the layer projects x straight to q and k of that
    width (Zoology's proj_q, proj_k), v to head_dim, and the short convolution, RoPE and
    decoding follow the widths."""
    from transformers_lab.attention.based import BasedAttention

    factory = functools.partial(BasedAttention, feature_dim=6, short_conv=3)
    layer = MultiHeadAttention(D_MODEL, HEADS, factory, rope_theta=10_000.0).double().eval()
    assert layer.qkv_proj.out_features == HEADS * (6 + 6) + D_MODEL
    assert layer.conv.weight.shape[0] == HEADS * (6 + 6) + D_MODEL and layer.rotary.head_dim == 6
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    q, k, v = layer.project(x, None)
    assert q.shape == k.shape == (2, HEADS, 9, 6) and v.shape == (2, HEADS, 9, D_MODEL // HEADS)
    want = layer(x, causal=True)
    state, outs = None, []
    for t in range(9):
        out, state = layer.decode(x[:, t : t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), want)
    assert layer.state_size(9) == layer.kernel.state_size(9) + 2 * (HEADS * 12 + D_MODEL)
    cross = MultiHeadAttention(D_MODEL, HEADS, functools.partial(BasedAttention, feature_dim=6),
                               cross=True, context_dim=12)  # fmt: skip
    assert cross.q_proj.out_features == HEADS * 6 and cross.kv_proj.out_features == HEADS * 6 + 16
    assert cross(torch.randn(2, 5, D_MODEL), torch.randn(2, 3, 12)).shape == (2, 5, D_MODEL)


def test_kernel_factory_from_a_partial():
    layer = MultiHeadAttention(D_MODEL, HEADS, functools.partial(FastmaxAttention, p=1))
    assert isinstance(layer.kernel, FastmaxAttention) and layer.kernel.p == 1


def test_heads_run_as_one_batched_op():
    """The kernel is called once per forward with all heads, not once per head."""
    layer = MultiHeadAttention(D_MODEL, HEADS, "softmax")
    calls = []
    layer.kernel.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape))
    layer(torch.randn(3, 5, D_MODEL))
    assert calls == [torch.Size([3, HEADS, 5, D_MODEL // HEADS])]


def test_decode_equals_full_causal_forward():
    layer = MultiHeadAttention(D_MODEL, HEADS, "fastmax").double().eval()
    x = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    full = layer(x, causal=True)
    out, state = layer.decode(x[:, :5])
    outs = [out]
    for t in range(5, 8):
        out, state = layer.decode(x[:, t : t + 1], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full)


def test_bad_configuration_is_refused_with_both_numbers():
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_head=4"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        MultiHeadAttention(D_MODEL, HEADS, "nope")
    with pytest.raises(TypeError, match="expected an AttentionKernel"):
        MultiHeadAttention(D_MODEL, HEADS, lambda **kw: torch.nn.Identity())
    with pytest.raises(ValueError, match="cross=True"):
        MultiHeadAttention(D_MODEL, HEADS, context_dim=8)


def test_bad_inputs_are_refused():
    layer = MultiHeadAttention(D_MODEL, HEADS, SoftmaxAttention)
    with pytest.raises(ValueError, match=r"expected x of shape \(batch, tokens, d_model=16\)"):
        layer(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match="takes no context"):
        layer(torch.randn(2, 5, D_MODEL), torch.randn(2, 5, D_MODEL))
    cross = MultiHeadAttention(D_MODEL, HEADS, cross=True)
    with pytest.raises(ValueError, match="needs a context"):
        cross(torch.randn(2, 5, D_MODEL))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_prepared_memory_equals_cross_attention(name):
    if getattr(KERNELS[name], "positional", False):
        pytest.skip(f"{name} takes no cross-attention (test_every_kernel_runs_in_self_and_cross)")
    if KERNELS[name](head_dim=8, n_head=2).noncausal_refusal():
        with pytest.raises(ValueError, match=f"attention={name} .* causal only"):
            MultiHeadAttention(D_MODEL, HEADS, name, cross=True)
        return
    layer = MultiHeadAttention(D_MODEL, HEADS, name, cross=True).double().eval()
    x, mem = torch.randn(2, 4, D_MODEL).double(), torch.randn(2, 9, D_MODEL).double()
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 5:] = True
    prepared = layer.project_context(mem, pad)
    torch.testing.assert_close(layer(x, prepared), layer(x, mem, key_padding_mask=pad))
    weights = layer.attention_weights(x, mem, key_padding_mask=pad)
    if prepared.keys is None:  # a summary of the keys (fastmax's state): no weights from it
        with pytest.raises(ValueError, match="pass the context tensor"):
            layer.attention_weights(x, prepared)
    else:  # the memory's keys and mask give the same weights
        torch.testing.assert_close(layer.attention_weights(x, prepared), weights)


# ---------------------------------------------------------------- the heads' one name


def tempered_weights(kernel, q, k, *, causal=False, key_padding_mask=None):
    """softmax(tau_h q.k), tau_h the kernel's per-head ``log_tau`` (H, 1, 1) exponentiated."""
    kernel.check_inputs(q, k, None, key_padding_mask)
    nq, nk = q.shape[2], k.shape[2]
    allowed = attention_mask(
        nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
    )
    return masked_softmax(kernel.log_tau.exp() * (q @ k.transpose(-2, -1)), allowed)


class OldStyleKernel(AttentionKernel, register=False):
    """A user's kernel written to the old contract: its ``__init__`` takes ``num_heads``
    and sizes a parameter by it."""

    def __init__(self, head_dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__(head_dim, num_heads, dropout)
        self.log_tau = torch.nn.Parameter(torch.zeros(num_heads, 1, 1))

    weights = tempered_weights


class NewStyleKernel(AttentionKernel, register=False):
    def __init__(self, head_dim: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__(head_dim, n_head, dropout)
        self.log_tau = torch.nn.Parameter(torch.zeros(n_head, 1, 1))

    weights = tempered_weights


OLD_NOTE = (
    "note: OldStyleKernel takes num_heads; the kernel contract now calls it n_head "
    "(rename the parameter)"
)


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "takes num_heads" in r.getMessage()]


def test_an_old_style_kernel_builds_and_runs_in_a_layer_and_a_model_with_one_note(
    monkeypatch, caplog
):
    monkeypatch.setattr(contract, "NOTED", set())
    factory = functools.partial(OldStyleKernel, dropout=0.0)  # as Hydra's _partial_ gives it
    with caplog.at_level("WARNING"):
        layer = MultiHeadAttention(D_MODEL, HEADS, factory)
        x = torch.randn(2, 7, D_MODEL)
        out = layer(x, causal=True)
        out.sum().backward()
        assert out.shape == x.shape and layer.kernel.log_tau.grad is not None
        assert layer.kernel.n_head == HEADS and layer.kernel.log_tau.shape == (HEADS, 1, 1)
        model = GPT(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, attention=factory)
        assert model(torch.randint(0, 11, (2, 8))).shape[:2] == (2, 8)
        assert all(b.mixer.kernel.n_head == 2 for b in model.blocks)
    assert notes(caplog) == [OLD_NOTE]  # once for the class, not once a layer


def test_a_caller_of_the_old_keyword_builds_each_built_in_kernel_with_one_note(monkeypatch, caplog):
    """``num_heads=`` from a caller of the earlier contract works on every kernel of ours,
    with one note a class that names the new keyword."""
    monkeypatch.setattr(contract, "NOTED", set())
    from transformers_lab.attention.gated_deltanet import GatedDeltaNetAttention

    with caplog.at_level("WARNING"):
        for _ in range(2):
            for cls in (SoftmaxAttention, FastmaxAttention, GatedDeltaNetAttention):
                kernel = cls(head_dim=8, num_heads=2)
                assert kernel.n_head == 2
        assert FastmaxAttention(8, num_heads=3, p=1).n_head == 3
    said = [r.getMessage() for r in caplog.records if "num_heads" in r.getMessage()]
    assert said == [
        f"note: {name}(num_heads=...) is now {name}(n_head=...)"
        for name in ("SoftmaxAttention", "FastmaxAttention", "GatedDeltaNetAttention")
    ]
    with pytest.raises(TypeError):  # both: Python's own refusal of a repeated argument
        SoftmaxAttention(8, 2, num_heads=2)


def test_a_new_style_kernel_gets_n_head_and_no_note(monkeypatch, caplog):
    monkeypatch.setattr(contract, "NOTED", set())
    with caplog.at_level("WARNING"):
        layer = MultiHeadAttention(D_MODEL, HEADS, functools.partial(NewStyleKernel))
        assert layer(torch.randn(2, 5, D_MODEL), causal=True).shape == (2, 5, D_MODEL)
        assert layer.kernel.n_head == HEADS and layer.kernel.log_tau.shape == (HEADS, 1, 1)
        seen = {}
        call_with_heads(lambda **sizes: seen.update(sizes), 3, head_dim=8)  # no names to read
        assert seen == {"head_dim": 8, "n_head": 3}
    assert notes(caplog) == []
