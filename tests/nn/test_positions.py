"""Positions that act on queries and keys: RoPE's rotations and its relative property."""

from __future__ import annotations

import math

import pytest
import torch

from transformers_lab.attention import KERNELS, build_kernel
from transformers_lab.models import GPT, EncoderClassifier, ViT
from transformers_lab.nn import MultiHeadAttention
from transformers_lab.nn.rotary import Rotary

B, H, N, D = 2, 3, 7, 8


def test_rope_rotates_each_pair_by_position_times_its_frequency():
    rotary = Rotary(D, theta=100.0).double()
    x = torch.randn(1, 1, 5, D, dtype=torch.float64)
    out = rotary(x, offset=3)
    for m in range(5):
        for i in range(D // 2):
            angle = (m + 3) * 100.0 ** (-2 * i / D)
            a, b = x[0, 0, m, i], x[0, 0, m, i + D // 2]
            want = (
                a * math.cos(angle) - b * math.sin(angle),
                a * math.sin(angle) + b * math.cos(angle),
            )
            got = (out[0, 0, m, i], out[0, 0, m, i + D // 2])
            torch.testing.assert_close(torch.stack(got), torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation


@pytest.mark.parametrize(
    ("kernel", "options"), [("softmax", {}), ("fastmax", {"p": 2}), ("fastmax", {"p": 1})]
)
def test_rope_weights_depend_on_relative_positions_only(kernel, options):
    """Every position shifted by the same offset: the same weights (q·k of rotated vectors
    depends on m - n), for softmax and for a linear kernel whose weights are a function of
    q·k (fastmax normalises each token by its own norm, which a rotation keeps)."""
    rotary = Rotary(D).double()
    attention = build_kernel(kernel, head_dim=D, n_head=H, **options).double()
    q = torch.randn(B, H, N, D, dtype=torch.float64)
    k = torch.randn(B, H, N, D, dtype=torch.float64)
    at_zero = attention.weights(rotary(q), rotary(k), causal=True)
    for offset in (1, 17, 1000):
        shifted = attention.weights(rotary(q, offset), rotary(k, offset), causal=True)
        torch.testing.assert_close(shifted, at_zero, rtol=1e-9, atol=1e-12)
    plain = attention.weights(q, k, causal=True)
    assert not torch.allclose(plain, at_zero)  # the rotation did change the weights


def test_rope_in_multi_head_attention_decodes_from_where_the_cache_ends():
    torch.manual_seed(0)
    for kernel in ("softmax", "linear", "fastmax"):
        mha = MultiHeadAttention(16, 2, kernel, rope_theta=500.0).double().eval()
        x = torch.randn(2, 9, 16, dtype=torch.float64)
        full = mha(x, causal=True)
        out, state = mha.decode(x[:, :4])
        steps = [out]
        for t in range(4, 9):
            out, state = mha.decode(x[:, t : t + 1], state)
            steps.append(out)
        assert state.seen == 9  # the tokens seen
        torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_rope_reaches_every_models_self_attention_and_no_cross_attention():
    gpt = GPT(10, 8, n_layer=2, n_head=2, d_model=8, pos_encoding="rope", rope_theta=50.0)
    assert all(b.mixer.rotary is not None and b.mixer.rotary.theta == 50.0 for b in gpt.blocks)
    assert gpt.pos.table_rows(8) is None  # nothing added to the embeddings
    vit = ViT(image_size=8, patch_size=4, num_classes=3, d_model=8, n_layer=1, n_head=2,
              pos_encoding="rope")  # fmt: skip
    assert vit.blocks[0].mixer.rotary is not None
    assert vit(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    enc = EncoderClassifier(3, vocab_size=10, block_size=8, d_model=8, n_layer=1, n_head=2)
    assert enc.blocks[0].mixer.rotary is None  # sinusoidal by default
    from transformers_lab.models import Transformer

    t = Transformer(10, 10, d_model=8, n_head=2, n_encoder_layers=1, n_decoder_layers=1,
                    block_size=8, pos_encoding="rope")  # fmt: skip
    assert t.encoder[0].mixer.rotary is not None and t.decoder[0].mixer.rotary is not None
    assert t.decoder[0].cross.rotary is None


def test_rope_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="rope needs an even head dim .* got head_dim=3"):
        GPT(10, 8, n_layer=1, n_head=2, d_model=6, pos_encoding="rope")
    with pytest.raises(ValueError, match="rope_theta must be greater than 1"):
        Rotary(4, theta=1.0)
    with pytest.raises(ValueError, match="rope_theta is for self-attention"):
        MultiHeadAttention(8, 2, cross=True, rope_theta=1e4)


# ---------------------------------------------------------------- ALiBi


def paper_slopes(n: int) -> list[float]:
    """Press et al. (2022): for 2^k heads the geometric sequence 2^(-8/n), 2^(-16/n), ...;
    otherwise the 2^floor(log2 n) slopes, then the odd-numbered ones of twice as many."""
    m = 2 ** math.floor(math.log2(n))
    slopes = [2 ** (-8 * (i + 1) / m) for i in range(m)]
    return slopes + [2 ** (-8 * (2 * i + 1) / (2 * m)) for i in range(n - m)]


@pytest.mark.parametrize("heads", [8, 12])
def test_alibi_slopes_and_bias_follow_the_paper(heads):
    from transformers_lab.attention.masks import alibi_bias, alibi_slopes

    slopes = alibi_slopes(heads)
    assert slopes == pytest.approx(paper_slopes(heads), rel=1e-12)
    if heads == 8:
        assert slopes == pytest.approx([2.0**-i for i in range(1, 9)])
    else:
        assert slopes[8:] == pytest.approx([2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5])
    bias = alibi_bias(torch.tensor(slopes, dtype=torch.float64), 5, 5)
    for h in range(heads):
        for i in range(5):
            for j in range(i + 1):  # causal: the key j tokens back gets -slope * (i - j)
                assert bias[h, i, j] == pytest.approx(-slopes[h] * (i - j))


SCORE_KERNELS = [name for name, cls in KERNELS.items() if cls.forms_scores]


@pytest.mark.parametrize("kernel", SCORE_KERNELS)
def test_every_kernel_that_forms_scores_takes_alibi_and_passes_the_contract(kernel):
    from transformers_lab.attention.check import check_kernel
    from transformers_lab.attention.resolve import kernel_factory
    from transformers_lab.attention.testbed import with_alibi

    assert check_kernel(with_alibi(kernel_factory(kernel))) == []
    plain = build_kernel(kernel, head_dim=D, n_head=H).double()
    biased = build_kernel(kernel, head_dim=D, n_head=H).double()
    biased.load_state_dict(plain.state_dict())
    biased.use_alibi()
    q, k = (
        torch.randn(B, H, N, D, dtype=torch.float64),
        torch.randn(B, H, N, D, dtype=torch.float64),
    )
    gates = plain.sample_gates(B, N, torch.float64)  # FoX's forget gate: the same for both
    assert not torch.allclose(
        biased.weights(q, k, causal=True, **gates), plain.weights(q, k, causal=True, **gates)
    )


def test_alibi_is_refused_by_kernels_that_form_no_scores_in_one_line():
    linear = [name for name, cls in KERNELS.items() if not cls.forms_scores]
    assert {"fastmax", "linear", "based", "performer"} <= set(linear)
    for name in linear:
        with pytest.raises(ValueError, match=f"pos_encoding=alibi .* attention={name} never"):
            GPT(10, 8, n_layer=1, n_head=2, d_model=8, pos_encoding="alibi", attention=name)
    gpt = GPT(10, 8, n_layer=1, n_head=2, d_model=8, pos_encoding="alibi")
    assert gpt.blocks[0].mixer.kernel.alibi and gpt.pos.table_rows(8) is None
    with pytest.raises(ValueError, match="alibi is for self-attention"):
        MultiHeadAttention(8, 2, cross=True, alibi=True)
