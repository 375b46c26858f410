"""The layer around a kernel, as the field builds it: short convolutions, gate inputs, the
output gate and norm, sliding windows, hybrid stacks (``nn/parts.py``, ``nn/mixers.py``,
``attention/sliding_window.py``, ``models/common.layer_choices``)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from transformers_lab.attention import AttentionKernel, masked_softmax
from transformers_lab.attention.base import GateInput
from transformers_lab.attention.check import check_kernel
from transformers_lab.attention.masks import attention_mask
from transformers_lab.attention.sliding_window import SlidingWindowAttention
from transformers_lab.check import main as check_main
from transformers_lab.models import GPT
from transformers_lab.models.common import layer_choices, layer_names
from transformers_lab.nn.check import layer_failures
from transformers_lab.nn.mixers import BaseConv
from transformers_lab.nn.multihead import MultiHeadAttention
from transformers_lab.nn.parts import ShortConvolution


def factory(name: str, **options):
    from functools import partial

    from transformers_lab.attention import kernel_class

    return partial(kernel_class(name), **options)


# ---------------------------------------------------------------- the short convolution


def test_the_short_convolution_reads_its_own_channel_over_the_last_k_inputs():
    torch.manual_seed(0)
    conv = ShortConvolution(3, 4).double()
    x = torch.randn(1, 10, 3, dtype=torch.float64)
    out, state = conv(x)
    # output t of channel c: silu(sum_i w[c, i] x[t - 3 + i, c]), zeros before the start
    padded = torch.cat([torch.zeros(1, 3, 3, dtype=torch.float64), x], dim=1)
    for t in range(10):
        window = padded[0, t : t + 4]  # (4, C)
        want = torch.nn.functional.silu((window.T * conv.weight[:, 0]).sum(-1))
        torch.testing.assert_close(out[0, t], want)
    torch.testing.assert_close(state, x[:, -3:])  # the last K - 1 inputs
    # step by step, the state carried, equals the whole
    steps, past = [], None
    for t in range(10):
        y, past = conv(x[:, t : t + 1], past)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), out)


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("with_past", [False, True])
def test_the_short_convolution_matches_conv1d_and_its_gradients_check(width, with_past):
    torch.manual_seed(0)
    conv = ShortConvolution(5, width, silu=False).double()
    x = torch.randn(2, 7, 5, dtype=torch.float64, requires_grad=True)
    past = torch.randn(2, width - 1, 5, dtype=torch.float64, requires_grad=True)
    full = torch.cat([past if with_past else torch.zeros_like(past), x], 1)
    want = torch.nn.functional.conv1d(full.transpose(1, 2), conv.weight, groups=5).transpose(1, 2)
    out, state = conv(x, past if with_past else None)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(state, full[:, full.shape[1] - (width - 1) :])
    inputs = (x, conv.weight) + ((past,) if with_past else ())

    def f(*args):
        return conv(args[0], args[2] if with_past else None)[0]

    assert torch.autograd.gradcheck(f, inputs)


def test_a_prompt_shorter_than_the_convolution_keeps_zeros_in_its_state():
    conv = ShortConvolution(3, 4)
    x = torch.randn(1, 2, 3)
    _, state = conv(x)
    assert state.shape == (1, 3, 3)
    torch.testing.assert_close(state, torch.cat([torch.zeros(1, 1, 3), x], 1))


@pytest.mark.parametrize("kernel", ["softmax", "fastmax", "linear", "based", "sliding_window"])
def test_a_layer_with_a_short_convolution_decodes_as_it_runs(kernel):
    options = {"window": 3} if kernel == "sliding_window" else {}
    failures, ran = layer_failures(factory(kernel, short_conv=4, **options))
    assert failures == []
    assert "layer decode" in ran and "layer gradcheck" in ran


def test_a_linear_kernel_with_a_short_convolution_keeps_a_constant_state():
    layer = MultiHeadAttention(16, 2, factory("fastmax", short_conv=4))
    assert layer.state_size(10) == layer.state_size(10_000)
    assert layer.state_size(10) == layer.kernel.state_size(10) + 3 * 3 * 16  # K - 1 inputs
    without = MultiHeadAttention(16, 2, factory("fastmax"))
    assert without.conv is None and layer.conv is not None


def test_the_short_convolution_changes_what_a_kernel_sees():
    """It runs before the kernel: q, k and v of a token mix in its predecessors'."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2, factory("softmax", short_conv=2)).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    q, k, v = layer.project(x, None)
    x2 = x.clone()
    x2[0, 1] += 1.0  # token 1 changes: token 2's q, k, v change, token 3's do not
    q2, _, _ = layer.project(x2, None)
    assert not torch.allclose(q[:, :, 2], q2[:, :, 2])
    torch.testing.assert_close(q[:, :, 3], q2[:, :, 3])
    torch.testing.assert_close(q[:, :, 0], q2[:, :, 0])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_a_short_conv_that_is_not_a_width_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="attention.short_conv must be an integer >= 0"):
        MultiHeadAttention(8, 2, factory("softmax", short_conv=bad))


def test_a_short_convolution_on_a_cross_attention_is_refused(tmp_path):
    with pytest.raises(ValueError, match="short_conv=4 convolves along one sequence"):
        MultiHeadAttention(8, 2, factory("softmax", short_conv=4), cross=True)
    # the Transformer's cross-attention shares its attention config unless given its own
    from transformers_lab.config import compose_config
    from transformers_lab.errors import ConfigError
    from transformers_lab.run.preflight import check_config

    shared = ["experiment=transformer_multi30k", "attention.short_conv=4"]
    with pytest.raises(ConfigError, match="attention: attention.short_conv=4 convolves along"):
        check_config(compose_config("train", shared, tmp_path / "a"))
    own = [*shared, "model.cross_attention=softmax"]
    check_config(compose_config("train", own, tmp_path / "b"))  # its own kernel: accepted


# ---------------------------------------------------------------- the other parts


def test_the_output_gate_and_norm_follow_their_formula():
    torch.manual_seed(0)
    plain = MultiHeadAttention(8, 2, factory("softmax")).double()
    layer = MultiHeadAttention(8, 2, factory("softmax", output_gate=True, output_norm=True))
    layer = layer.double()
    layer.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        layer.head_norm.weight.copy_(torch.rand(4, dtype=torch.float64) + 0.5)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    q, k, v = plain.project(x, None)
    o = plain.kernel(q, k, v, causal=True)  # (B, H, N, D)
    o = o / o.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * layer.head_norm.weight
    o = o.transpose(1, 2).reshape(2, 5, 8) * torch.nn.functional.silu(layer.gate_proj(x))
    torch.testing.assert_close(layer(x, causal=True), plain.out_proj(o))


def test_q_and_k_are_activated_then_normalised_per_head():
    layer = MultiHeadAttention(8, 2, factory("softmax", qk_activation="relu", qk_norm=True))
    q, k, _ = layer.project(torch.randn(1, 6, 8), None)
    norms = torch.cat([q, k]).norm(dim=-1)
    assert torch.allclose(norms[norms > 0], torch.ones_like(norms[norms > 0]), atol=1e-5)
    assert (q >= 0).all() and (k >= 0).all()
    with pytest.raises(ValueError, match="unknown attention.qk_activation 'tanh'"):
        MultiHeadAttention(8, 2, factory("softmax", qk_activation="tanh"))


def test_the_check_runs_the_layer_checks_where_a_part_is_on(capsys):
    assert check_main(["fastmax_p2", "short_conv=4"]) == 0
    out = capsys.readouterr().out
    assert "layer decode" in out and "layer gradcheck" in out
    assert check_main(["fastmax_p2"]) == 0
    assert "layer decode" not in capsys.readouterr().out  # the bare kernel: no layer checks


def test_the_layer_check_catches_a_convolution_that_reads_the_future(monkeypatch):
    """A convolution padded on the wrong side leaks: the layer checks must say so."""

    def leaky(self, x, past=None):
        out = torch.nn.functional.conv1d(
            torch.nn.functional.pad(x.transpose(1, 2), (0, self.width - 1)),
            self.weight.to(x.dtype),
            groups=x.shape[-1],
        ).transpose(1, 2)
        return torch.nn.functional.silu(out), x[:, -(self.width - 1) :]

    monkeypatch.setattr(ShortConvolution, "forward", leaky)
    failures, _ = layer_failures(factory("softmax", short_conv=3))
    assert any(f.startswith("layer future") for f in failures)
    assert any(f.startswith("layer decode") for f in failures)


# ---------------------------------------------------------------- gate inputs


class GatedSoftmax(AttentionKernel, register=False):
    """A test kernel with a gate input: key j's weight is g_j exp(q.k_j), normalised."""

    name = "gated_softmax"
    gate_inputs: ClassVar[dict[str, GateInput]] = {"g": GateInput("logsigmoid")}

    def weights(self, q, k, *, causal=False, key_padding_mask=None, g=None):
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + g[:, :, None, :]
        allowed = attention_mask(
            q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
            device=q.device,
        )  # fmt: skip
        return masked_softmax(scores, allowed)

    def reference_weights(self, q, k, *, causal=False, key_padding_mask=None, g=None):
        from transformers_lab.attention import naive

        allowed = naive.pair_mask(q, k, causal, key_padding_mask)
        scores = naive.dot(q, k) / q.shape[-1] ** 0.5 + g.double()[:, :, None, :]
        return naive.softmax_rows(scores, allowed)

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None, g=None):
        return self.weights(q, k, causal=causal, key_padding_mask=key_padding_mask, g=g) @ v

    def decode(self, q, k, v, state=None, *, key_padding_mask=None, g=None):
        if state is not None:  # the cache keeps the gates with the keys
            k0, v0, g0, m0 = state
            k, v, g = torch.cat([k0, k], 2), torch.cat([v0, v], 2), torch.cat([g0, g], 2)
            if m0 is not None or key_padding_mask is not None:
                m0 = torch.zeros(k0.shape[0], k0.shape[2], dtype=torch.bool) if m0 is None else m0
                new = key_padding_mask
                new = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool) if new is None else new
                key_padding_mask = torch.cat([m0, new], 1)
        out = self(q, k, v, causal=True, key_padding_mask=key_padding_mask, g=g)
        return out, (k, v, g, key_padding_mask)

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.n_head * n * (self.head_dim + value_dim + 1)


def test_a_kernel_declares_gate_inputs_and_the_layer_projects_them_from_x():
    layer = MultiHeadAttention(8, 2, GatedSoftmax)
    assert set(layer.gates.proj) == {"g"}
    gates = layer.gate_values(torch.randn(3, 5, 8))
    assert gates["g"].shape == (3, 2, 5) and (gates["g"] < 0).all()  # logsigmoid: log-decays
    assert check_kernel(GatedSoftmax) == []  # gates from the keys: decode == forward, grads
    failures, ran = layer_failures(GatedSoftmax)
    assert failures == [] and "layer decode" in ran


def test_a_kernel_with_gate_inputs_refuses_a_cross_attention():
    with pytest.raises(ValueError, match="takes inputs projected from each token \\(g\\)"):
        MultiHeadAttention(8, 2, GatedSoftmax, cross=True)


def test_per_channel_and_low_rank_gates_have_their_shapes():
    class Wide(GatedSoftmax, register=False):
        gate_inputs: ClassVar[dict[str, GateInput]] = {
            "a": GateInput("sigmoid", per_channel=True, rank=3)
        }

    layer = MultiHeadAttention(8, 2, Wide)
    assert layer.gates(torch.randn(1, 4, 8))["a"].shape == (1, 2, 4, 4)
    assert layer.gates.proj["a"][0].out_features == 3
    with pytest.raises(ValueError, match="unknown gate activation 'tanh'"):
        GateInput("tanh")


# ---------------------------------------------------------------- the sliding window


def test_sliding_window_weights_are_softmax_over_the_window_against_a_masked_reference():
    torch.manual_seed(0)
    kernel = SlidingWindowAttention(8, 2, window=3).double()
    q, k = (
        torch.randn(2, 2, 10, 8, dtype=torch.float64),
        torch.randn(2, 2, 10, 8, dtype=torch.float64),
    )
    w = kernel.weights(q, k, causal=True)
    i, j = torch.arange(10)[:, None], torch.arange(10)[None, :]
    band = (i - j >= 0) & (i - j < 3)
    scores = (q @ k.mT) / 8**0.5
    torch.testing.assert_close(w, masked_softmax(scores, band))
    both = kernel.weights(q, k, causal=False)
    torch.testing.assert_close(both, masked_softmax(scores, (i - j).abs() < 3))


@pytest.mark.parametrize("causal", [True, False])
def test_the_blocked_path_equals_the_whole_matrix_and_holds_o_n_w_scores(causal, monkeypatch):
    torch.manual_seed(0)
    kernel = SlidingWindowAttention(4, 2, window=5).double()
    q, k, v = (torch.randn(1, 2, 40, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[0, 17] = True
    want = kernel.weights(q, k, causal=causal, key_padding_mask=mask) @ v
    from transformers_lab.attention import sliding_window as module

    widths = []
    real = module.masked_softmax
    monkeypatch.setattr(
        module, "masked_softmax", lambda s, a: widths.append(s.shape[-1]) or real(s, a)
    )
    got = kernel(q, k, v, causal=causal, key_padding_mask=mask)
    torch.testing.assert_close(got, want)
    assert widths == [(2 if causal else 3) * 5]  # each block of W queries: 2W (3W) keys


def test_sliding_window_decodes_with_a_ring_buffer_of_w_keys():
    torch.manual_seed(0)
    kernel = SlidingWindowAttention(4, 2, window=3).double()
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64) for _ in range(3))
    want = kernel(q, k, v, causal=True)
    state, outs = None, []
    for t in range(12):
        out, state = kernel.decode(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state
        )
        outs.append(out)
        assert state[0].shape[2] == 3  # W slots, whatever t
    torch.testing.assert_close(torch.cat(outs, 2), want)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_a_window_that_is_not_positive_is_refused(bad):
    with pytest.raises(ValueError, match="attention.window must be a positive integer"):
        SlidingWindowAttention(4, 2, window=bad)


def test_the_check_passes_the_sliding_window_with_alibi(capsys):
    assert check_main(["sliding_window", "window=3", "--alibi"]) == 0


# ---------------------------------------------------------------- hybrid stacks


def test_layer_choices_repeat_a_pattern_or_change_some_layers():
    assert layer_choices(4, "A", None) == ["A"] * 4
    assert layer_choices(4, "A", ["b", "attention"]) == ["b", "A", "b", "A"]
    assert layer_choices(3, "A", {1: "s"}) == ["A", "s", "A"]
    # Based-360M's period: BaseConv, Based, sliding window, BaseConv, BaseConv
    pattern = ["base_conv", "based", "sliding_window", "base_conv", "base_conv"]
    assert layer_choices(10, "A", pattern)[5:] == pattern
    with pytest.raises(ValueError, match="has 3 entries, which does not divide n_layer=4"):
        layer_choices(4, "A", ["a", "b", "c"])
    with pytest.raises(ValueError, match="names layer 4, but the model's layers are 0..3"):
        layer_choices(4, "A", {4: "s"})


def test_a_hybrid_gpt_builds_each_layer_as_chosen_and_generates_as_it_runs():
    from functools import partial

    torch.manual_seed(0)
    gpt = GPT(
        50, 16, n_layer=4, n_head=2, d_model=16,
        attention=factory("fastmax", short_conv=3),
        hybrid=[partial(BaseConv, kernel_size=3), "attention"],
    ).double().eval()  # fmt: skip
    assert layer_names(gpt) == ["base_conv", "fastmax(p=2, short_conv=3)"] * 2
    assert isinstance(gpt.blocks[0].mixer, BaseConv)
    assert gpt.state_size(10) == gpt.state_size(1000)  # conv windows and a linear state
    idx = torch.randint(0, 50, (2, 11))
    full = gpt(idx)
    # incremental: the first 6 tokens at once, then one at a time
    x = gpt.embed(idx[:, :6])
    states = [None] * 4
    for i, block in enumerate(gpt.blocks):
        x, states[i] = block.decode(x, states[i])
    outs = [gpt.lm_head(gpt.norm(x))]
    for t in range(6, 11):
        x = gpt.embed(idx[:, t : t + 1], offset=t)
        for i, block in enumerate(gpt.blocks):
            x, states[i] = block.decode(x, states[i])
        outs.append(gpt.lm_head(gpt.norm(x)))
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_fastmax_everywhere_but_one_layer():
    gpt = GPT(50, 16, n_layer=3, n_head=2, d_model=16, attention="fastmax", hybrid={1: "softmax"})
    assert layer_names(gpt) == ["fastmax(p=2)", "softmax", "fastmax(p=2)"]


@pytest.mark.parametrize("model", ["vit", "encoder"])
def test_an_encoder_takes_a_hybrid_stack_too(model):
    from transformers_lab.models import EncoderClassifier, ViT
    from transformers_lab.models.common import layer_names

    torch.manual_seed(0)
    options = dict(num_classes=3, n_layer=4, n_head=2, d_model=16, attention="softmax")
    if model == "vit":
        net = ViT(image_size=8, patch_size=4, hybrid={1: "fastmax", 3: "linear"}, **options)
        x = torch.randn(2, 1, 8, 8)
    else:
        net = EncoderClassifier(vocab_size=20, hybrid=["fastmax", "attention"], **options)
        x = torch.randint(0, 20, (2, 7))
    want = (
        ["softmax", "fastmax(p=2)", "softmax", "linear"]
        if model == "vit"
        else ["fastmax(p=2)", "softmax"] * 2
    )
    assert layer_names(net) == want
    assert net(x).shape == (2, 3)


def test_alibi_with_a_linear_kernel_inside_a_hybrid_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"model.hybrid, layer 1 \(fastmax\): pos_encoding=alibi"):
        GPT(50, 16, n_layer=2, n_head=2, d_model=16, pos_encoding="alibi",
            hybrid=["softmax", "fastmax"])  # fmt: skip


def test_base_conv_is_zoologys_gated_convolution():
    torch.manual_seed(0)
    mixer = BaseConv(6, kernel_size=3).double()
    x = torch.randn(2, 7, 6, dtype=torch.float64)
    conv = torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (2, 0)), mixer.conv.weight, mixer.conv.bias,
        groups=6,
    ).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(mixer(x), conv * mixer.projection(x) + x)
    with pytest.raises(ValueError, match="base_conv.kernel_size must be an integer >= 1"):
        BaseConv(6, kernel_size=0)


class OldStyleMixer(BaseConv):
    """A user's mixer written when the head count was called ``num_heads``."""

    def __init__(self, d_model: int, num_heads: int, kernel_size: int = 3) -> None:
        super().__init__(d_model, kernel_size=kernel_size)
        self.heads_given = num_heads


def test_a_mixer_takes_n_head_and_an_old_style_one_builds_with_a_note(monkeypatch, caplog):
    from functools import partial

    from transformers_lab.attention import contract
    from transformers_lab.nn.layers import sequence_mixer

    monkeypatch.setattr(contract, "NOTED", set())
    with caplog.at_level("WARNING"):
        assert isinstance(sequence_mixer(6, 2, partial(BaseConv, kernel_size=2)), BaseConv)
        assert not caplog.records
        old = [sequence_mixer(6, 2, partial(OldStyleMixer, kernel_size=2)) for _ in range(2)]
    assert [m.heads_given for m in old] == [2, 2]
    assert old[0](torch.randn(1, 4, 6)).shape == (1, 4, 6)
    assert [r.getMessage() for r in caplog.records] == [
        "note: OldStyleMixer takes num_heads; the mixer contract now calls it n_head "
        "(rename the parameter)"
    ]


def test_a_hybrid_from_the_command_line_trains_and_its_layers_are_recorded(tmp_path):
    """``model.hybrid`` names attention options and mixers, as the command line gives them;
    the run's outcome (its job record's ``layers``) says what each layer was."""
    from transformers_lab.config import compose_config
    from transformers_lab.run.fit import fit_and_test

    overrides = [
        "experiment=mqar", "model.hybrid=[base_conv,attention]", "attention=based",
        "attention.short_conv=2", "debug=fdr", "logger=csv", "trainer.enable_progress_bar=false",
    ]  # fmt: skip
    outcome = fit_and_test(compose_config("train", overrides, tmp_path / "run"))
    assert outcome.layers == ["base_conv", "based(short_conv=2)"]
    assert all(torch.isfinite(torch.tensor(v)) for v in outcome.metrics.values())


def test_a_hybrid_on_a_model_without_one_is_refused_in_one_line(tmp_path):
    from transformers_lab.config import compose_config
    from transformers_lab.errors import ConfigError
    from transformers_lab.run.preflight import check_config

    overrides = ["experiment=transformer_multi30k", "+model.hybrid=[softmax,fastmax]"]
    cfg = compose_config("train", overrides, tmp_path / "r")
    with pytest.raises(ConfigError, match="^model.hybrid: Transformer takes no hybrid; remove it"):
        check_config(cfg)


@pytest.mark.parametrize(
    ("hybrid", "error"),
    [
        ("[base_conv,nope]", "model.hybrid: unknown layer 'nope'; valid ones are: attention, "),
        ("[softmax,softmax,softmax]", "has 3 entries, which does not divide n_layer=2"),
    ],
)
def test_a_bad_hybrid_is_refused_before_anything_is_built(tmp_path, hybrid, error):
    from transformers_lab.config import compose_config
    from transformers_lab.errors import ConfigError
    from transformers_lab.run.preflight import check_config

    cfg = compose_config("train", ["experiment=mqar", f"model.hybrid={hybrid}"], tmp_path / "r")
    with pytest.raises(ConfigError, match=error.replace("[", "\\[")):
        check_config(cfg)


def test_the_summary_names_each_layer_where_a_stack_is_hybrid():
    from transformers_lab.run.record import JobRecord
    from transformers_lab.sweeps.report.collect import Run
    from transformers_lab.sweeps.report.tables import job_rows

    def run(job, layers):
        record = JobRecord(status="ok", metrics={"val/acc": 0.5}, layers=layers)
        return Run(job=job, source="", record=record)

    hybrid = [run("0", ["base_conv", "based"]), run("1", ["based", "based"])]
    rows = job_rows(hybrid, "val/acc")
    assert [r["layers"] for r in rows] == ["base_conv, based", "based, based"]
    alike = [run("0", ["softmax", "softmax"]), run("1", ["fastmax", "fastmax"])]
    assert "layers" not in job_rows(alike, "val/acc")[0]  # the attention choice says it
