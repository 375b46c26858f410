"""Every kernel against the contract (``attention.check``: its own float64 reference,
masks, decode, gradients), the check itself against broken kernels, and what is
particular to each kernel."""

from __future__ import annotations

import functools
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import (
    KERNELS,
    AdditiveAttention,
    AttentionKernel,
    CosineAttention,
    FastmaxAttention,
    SoftmaxAttention,
    build_kernel,
)
from transformers_lab.attention import check as check_module
from transformers_lab.attention.check import check_kernel
from transformers_lab.attention.gated.kernel import GatedKernel
from transformers_lab.attention.performer import PerformerAttention
from transformers_lab.attention.resolve import kernel_factory
from transformers_lab.attention.testbed import build
from transformers_lab.check import main as check_main

B, H, D = 2, 3, 8
NAMES = sorted(KERNELS)
# every registered kernel with its defaults, and the options that take other code paths
KERNEL_CONFIGS = [(name, {}) for name in NAMES] + [
    ("additive", {"attn_dim": 5, "bias": False}),
    ("additive", {"memory_budget_mb": 1e-3}),  # one query per chunk
    ("fastmax", {"p": 1, "impl": "linear"}),
    ("fastmax", {"p": 2, "impl": "linear"}),
    ("fastmax", {"p": 2, "scale": 2.5, "normalize": False, "chunk_size": 3, "impl": "linear"}),
    ("fastmax", {"p": 2, "impl": "quadratic"}),
    ("fastmax", {"normalize": "sequence_max", "impl": "linear"}),  # checked non-causal
    ("fastmax", {"learn_scale": True, "scale": 2.0, "impl": "linear", "chunk_size": 4}),
    ("linear", {"impl": "linear", "chunk_size": 3}),  # the shared engine with p = 0
    ("based", {"impl": "linear", "chunk_size": 3, "feature_dim": 5}),
    ("performer", {"impl": "linear", "chunk_size": 3, "num_features": 7, "seed": 1}),
    ("cosformer", {"impl": "linear", "chunk_size": 3, "max_len": 12}),  # positions in decode
    ("sigmoid", {"bias": -1.5, "scale": 0.7}),
    ("relu", {"scale": 2.0}),
]
CONFIG_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in KERNEL_CONFIGS]


def make(name: str, dtype: torch.dtype = torch.float64, **options) -> AttentionKernel:
    kernel = build_kernel(name, head_dim=D, n_head=H, **options).to(dtype)
    with torch.no_grad():  # move learned parameters off their init, so tests see them
        for p in kernel.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return kernel.eval()


def qkv(
    nq: int, nk: int, dtype=torch.float64, dv: int = D, requires_grad: bool = False, qk: int = D
):
    q = torch.randn(B, H, nq, qk, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, H, nk, qk, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, H, nk, dv, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def padding(nk: int) -> torch.Tensor:
    """Batch 0 unpadded, batch 1 with its last two keys padded."""
    mask = torch.zeros(B, nk, dtype=torch.bool)
    mask[1, -2:] = True
    return mask


@pytest.mark.parametrize(("name", "options"), KERNEL_CONFIGS, ids=CONFIG_IDS)
def test_every_kernel_passes_the_contract(name, options):
    assert check_kernel(kernel_factory(name, options)) == []


def test_every_kernel_declares_itself():
    for name, cls in KERNELS.items():
        assert cls.name == name and isinstance(cls.normalized, bool)
        assert cls.reference_weights is not AttentionKernel.reference_weights, name
        kernel = build_kernel(name, head_dim=D, n_head=H)
        grows = kernel.state_size(1000) > kernel.state_size(10)
        assert grows != cls.constant_state, name


# ---------------------------------------------------------------- the check catches


class Leaky(SoftmaxAttention, register=False):
    """Ignores causal: sees the future."""

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None):
        return super().forward(q, k, v, key_padding_mask=key_padding_mask)


class Unnormalised(SoftmaxAttention, register=False):
    """Rows that sum to 2, while declaring normalized."""

    def weights(self, q, k, **kw):
        return 2 * super().weights(q, k, **kw)

    def forward(self, q, k, v, **kw):
        return 2 * super().forward(q, k, v, **kw)

    def reference_weights(self, q, k, **kw):
        return 2 * super().reference_weights(q, k, **kw)


class ForgetfulDecode(SoftmaxAttention, register=False):
    """Decodes each token as if it were the first."""

    def decode(self, q, k, v, state=None, *, key_padding_mask=None):
        return super().decode(q, k, v, None, key_padding_mask=key_padding_mask)


class PaddingBlind(SoftmaxAttention, register=False):
    def forward(self, q, k, v, *, causal=False, key_padding_mask=None):
        return super().forward(q, k, v, causal=causal)


class SlightlyOff(SoftmaxAttention, register=False):
    """A forward 1e-7 away from its reference (a float32 accumulation, say)."""

    def forward(self, q, k, v, **kw):
        return super().forward(q, k, v, **kw) * (1 + 1e-7)


@pytest.mark.parametrize(
    ("cls", "caught"),
    [
        (Leaky, {"reference", "weights", "future", "decode"}),
        (Unnormalised, {"rows"}),
        (ForgetfulDecode, {"decode"}),
        (PaddingBlind, {"reference", "weights", "padding", "masked"}),
        (SlightlyOff, {"reference", "weights"}),
    ],
)
def test_the_check_names_what_a_broken_kernel_breaks(cls, caught):
    failures = check_kernel(functools.partial(cls))
    assert {line.split(":", 1)[0] for line in failures} == caught, failures
    assert all("\n" not in line for line in failures)


def test_the_check_command_prints_a_line_per_failure_and_its_status(capsys):
    assert check_main(["softmax"]) == 0
    # the count is of the checks the checker defines and gives softmax: all but refusal
    ran = check_module.checks_for(build(kernel_factory("softmax")))
    assert ran == [name for name in check_module.CHECKS if name != "refusal"]
    out = capsys.readouterr().out
    ok = re.fullmatch(r"ok: softmax passes the (\d+) checks \((.*)\)\n", out)
    assert ok and int(ok[1]) == len(ran) and ok[2].split(", ") == ran, out
    assert check_main([f"{__name__}.ForgetfulDecode"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out and all(
        line.startswith(f"FAIL {__name__}.ForgetfulDecode: decode: ") for line in out
    )
    assert check_main(["fastmax", "p=1", "impl=linear"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fastmx"], "unknown kernel 'fastmx' (did you mean fastmax?); valid: additive, based"),
        (["mine", "--config-dir", "."], "no attention/ folder in the config dir"),
        (["nowhere.Kernel"], "cannot import nowhere for nowhere.Kernel"),
        (["torch.nn.Linear"], "torch.nn.Linear is not an AttentionKernel subclass"),
        (["fastmax", "p=3"], "unsupported Taylor order p=3"),
        (["fastmax", "p"], "options are key=value, got 'p'"),
        (["no/such.yaml"], "no kernel config at no/such.yaml"),
    ],
)
def test_the_check_command_refuses_a_target_it_cannot_build(argv, message, capsys):
    assert check_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_the_readme_kernel_table_is_written_from_the_registry(monkeypatch):
    import importlib
    from pathlib import Path

    from transformers_lab.attention.__main__ import kernel_table, with_table

    tests = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(tests / "user"))
    importlib.import_module("user_kernels.relu2")  # a user's kernel, registered: not the README's
    readme = (tests.parent / "README.md").read_text()
    table = kernel_table()  # composes every option: once (a minute on 2 busy cores)
    assert with_table(readme, table) == readme, "the table is stale: run make docs"
    assert all(f"| `{name}` |" in table for name in NAMES)
    assert "relu2" in KERNELS and "| `relu2` |" not in table


def test_a_kernel_name_cannot_be_taken_twice():
    with pytest.raises(TypeError, match="the attention kernel name 'softmax' is taken by"):

        class Impostor(SoftmaxAttention):
            name = "softmax"

    assert KERNELS["softmax"] is SoftmaxAttention


@pytest.mark.parametrize("p", [1, 2])
def test_fastmax_sequence_max_is_the_authors_fastmax_function(p):
    """The non-causal formula of ``fastmax_function`` (armingerami/fastmax, model.py) with
    normalize=1, lim=1, a0=1, a1=1, a2=1/2, written out with its own sums: q and k divided
    by the largest token norm of their sequence, per batch and head; then
    (a0 sum v + a1 q (k^T v) + a2 q2 (k2^T v)) / (a0 n + a1 q sum k + a2 q2 sum k2), with
    q2 = q (x) q flattened."""
    q, k, v = qkv(6, 9, dv=5)
    qn = q / q.norm(dim=3).amax(dim=2)[..., None, None]
    kn = k / k.norm(dim=3).amax(dim=2)[..., None, None]
    num = v.sum(-2, keepdim=True) + qn @ (kn.transpose(-2, -1) @ v)
    den = k.shape[2] + qn @ kn.sum(-2)[..., None]
    if p == 2:
        q2 = (qn[..., :, None] * qn[..., None, :]).flatten(-2)
        k2 = (kn[..., :, None] * kn[..., None, :]).flatten(-2)
        num = num + 0.5 * q2 @ (k2.transpose(-2, -1) @ v)
        den = den + 0.5 * q2 @ k2.sum(-2)[..., None]
    for impl in ("quadratic", "linear"):
        kernel = make("fastmax", p=p, normalize="sequence_max", impl=impl)
        torch.testing.assert_close(kernel(q, k, v), num / den)


def test_fastmax_sequence_max_is_refused_where_attention_is_causal():
    from transformers_lab.models import GPT, EncoderClassifier

    kernel = make("fastmax", normalize="sequence_max")
    q, k, v = qkv(4, 4)
    with pytest.raises(ValueError, match="sequence_max divides every token by the largest"):
        kernel(q, k, v, causal=True)
    with pytest.raises(ValueError, match="would see the future"):
        kernel.decode(q, k, v)
    factory = functools.partial(FastmaxAttention, normalize="sequence_max")
    with pytest.raises(ValueError, match="GPT attends causally: fastmax normalize=sequence_max"):
        GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, d_model=8, attention=factory)
    encoder = EncoderClassifier(num_classes=3, vocab_size=10, block_size=8, n_layer=1, n_head=2,
                                d_model=8, attention=factory)  # fmt: skip
    assert encoder(torch.randint(0, 10, (2, 8))).shape[0] == 2
    with pytest.raises(ValueError, match="normalize must be true, false, 'token' or"):
        FastmaxAttention(head_dim=D, n_head=H, normalize="max")


def test_fastmax_learns_its_scale_per_head_within_its_bound():
    kernel = FastmaxAttention(head_dim=D, n_head=H, scale=0.5, learn_scale=True)
    torch.testing.assert_close(kernel.temperature(), torch.full((H, 1, 1), 0.5))
    q, k, v = qkv(5, 5, dtype=torch.float32)
    kernel(q, k, v, causal=True).sum().backward()
    assert kernel.log_scale.grad is not None and kernel.log_scale.grad.abs().sum() > 0
    p1 = FastmaxAttention(head_dim=D, n_head=H, p=1, scale=0.5, learn_scale=True)
    with torch.no_grad():
        p1.log_scale.fill_(3.0)
    torch.testing.assert_close(p1.temperature(), torch.ones(H, 1, 1))  # p=1 stays positive
    assert not hasattr(make("fastmax"), "log_scale")


def test_based_is_fastmax_p2_without_normalisation_on_feature_dim_wide_queries_and_keys():
    based = make("based", feature_dim=6)
    assert (based.qk_dim, based.head_dim) == (6, D)  # q and k are 6 wide, v is D wide
    q, k, v = qkv(7, 9, qk=6)
    fastmax = FastmaxAttention(head_dim=6, n_head=H, p=2, normalize=False, scale=6**-0.5)
    torch.testing.assert_close(based(q, k, v, causal=True), fastmax(q, k, v, causal=True))
    assert based.state_size(1, D) == H * (D + 1) * (1 + 6 + 6 * 7 // 2)
    assert list(based.parameters()) == []  # the layer's projections are its only weights
    with pytest.raises(ValueError, match=r"based: kernel was built for qk_dim=6, n_head=3"):
        based(*qkv(7, 9))  # q and k of head_dim


@pytest.mark.parametrize("name", ["linear", "based", "cosformer", "performer"])
def test_a_linear_kernel_names_its_own_options_and_takes_the_engines(name):
    """The engine's options are written once (``FeatureKernel``): a kernel's signature
    lists them after its own, keyword only, with the engine's defaults, and passes them on."""
    engine = {"chunk_size": 128, "impl": "auto", "compiled": False, "backend": "auto"}
    params = inspect.signature(KERNELS[name]).parameters
    assert list(params)[-4:] == list(engine)
    assert all(params[key].kind is inspect.Parameter.KEYWORD_ONLY for key in engine)
    assert {key: params[key].default for key in engine} == engine
    kernel = KERNELS[name](8, 2, chunk_size=4, impl="linear", compiled=True, backend="loop")
    got = (kernel.chunk_size, kernel.impl, kernel.compiled, kernel.backend)
    assert got == (4, "linear", True, "loop")
    with pytest.raises(ValueError, match=f"^{name}: chunk_size must be >= 1, got 0$"):
        KERNELS[name](8, 2, chunk_size=0)


def test_performer_features_are_seeded_orthogonal_and_redrawn_in_training_only():
    a = PerformerAttention(head_dim=D, n_head=H, num_features=12, seed=5)
    b = PerformerAttention(head_dim=D, n_head=H, num_features=12, seed=5)
    assert a.omega.shape == (H, 12, D) and torch.equal(a.omega, b.omega)
    assert not torch.equal(a.omega, PerformerAttention(D, H, num_features=12, seed=6).omega)
    torch.manual_seed(3)
    c = PerformerAttention(head_dim=D, n_head=H, num_features=12)
    torch.manual_seed(3)
    assert torch.equal(c.omega, PerformerAttention(D, H, num_features=12).omega)
    block = a.omega[0, :D] / a.omega[0, :D].norm(dim=-1, keepdim=True)  # one block of D rows
    torch.testing.assert_close(block @ block.T, torch.eye(D), atol=1e-5, rtol=0)
    q, k, v = qkv(5, 5, dtype=torch.float32)
    before = a.omega.clone()
    a.eval()(q, k, v)
    assert torch.equal(a.omega, before)  # no redraw unless asked
    redrawing = PerformerAttention(head_dim=D, n_head=H, num_features=12, seed=5, redraw=True)
    redrawing.eval()(q, k, v)
    assert torch.equal(redrawing.omega, before)
    redrawing.train()(q, k, v)
    assert not torch.equal(redrawing.omega, before)


def test_performer_estimates_softmax_without_bias():
    """The error falls as 1/sqrt(m): an estimator with a bias (non-uniform rotations, a
    wrong scale) would level off."""
    q, k, _ = qkv(6, 6)
    q, k = q / 2, k / 2  # moderate scores: the estimator's variance grows with exp(|q||k|)
    want = (q @ k.transpose(-2, -1) / D**0.5).softmax(-1)

    def error(m: int) -> float:
        kernel = PerformerAttention(head_dim=D, n_head=H, num_features=m, seed=0).double()
        return (kernel.weights(q, k) - want).abs().mean().item()

    few, many = error(128), error(8192)  # 64 times the features: about 8 times closer
    assert many < 0.004 and many < few / 4, (few, many)


def test_sigmoid_and_relu_weigh_each_key_by_the_count_of_visible_keys():
    q, k, _ = qkv(4, 4)
    s = q @ k.transpose(-2, -1) / D**0.5
    n = torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None]  # causal: query i sees i + 1 keys
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    sigmoid = make("sigmoid").weights(q, k, causal=True)
    torch.testing.assert_close(sigmoid, torch.sigmoid(s - n.log()) * causal)
    assert make("sigmoid", bias=0.5).weights(q, k)[0, 0, 0, 0] == torch.sigmoid(s[0, 0, 0, 0] + 0.5)
    relu = make("relu").weights(q, k, causal=True)
    torch.testing.assert_close(relu, torch.relu(s) / n * causal)
    assert not KERNELS["sigmoid"].normalized and not KERNELS["relu"].normalized


def test_cosformer_weighs_nearby_keys_more_and_refuses_positions_past_max_len():
    kernel = make("cosformer", max_len=16)
    q = torch.ones(1, H, 1, D, dtype=torch.float64)
    k = torch.ones(1, H, 10, D, dtype=torch.float64)  # equal keys: only distance differs
    w = kernel.weights(q, k, causal=True)[0, 0, 0]  # the query at position 9
    assert (w.diff() > 0).all()  # the nearer the key, the larger its weight
    torch.testing.assert_close(
        w / w[-1], torch.cos(torch.pi / 32 * torch.arange(9, -1, -1.0)).double()
    )
    q, k, v = qkv(17, 17)
    with pytest.raises(ValueError, match="position 16 is past max_len=16; build it with"):
        kernel(q, k, v, causal=True)


def test_cosformer_rows_sum_to_1_where_relu_q_and_relu_k_never_overlap():
    """q positive where k is negative and the other way round: relu(q)·relu(k) = 0 for
    every pair, and without the feature floor every row (the first causal query's with
    its one key, too) would be all zero; each path and the reference give rows of 1."""
    kernel = make("cosformer", max_len=16)
    sign = torch.tensor([1.0, -1.0]).repeat_interleave(D // 2).double()
    q = torch.rand(1, H, 6, D, dtype=torch.float64) * sign
    k = -torch.rand(1, H, 6, D, dtype=torch.float64) * sign
    assert (torch.relu(q) @ torch.relu(k).transpose(-1, -2) == 0).all()
    rows = torch.ones(1, H, 6, dtype=torch.float64)
    for causal in (True, False):
        torch.testing.assert_close(kernel.weights(q, k, causal=causal).sum(-1), rows)
        torch.testing.assert_close(kernel.reference_weights(q, k, causal=causal).sum(-1), rows)
    ones = torch.ones(1, H, 6, 1, dtype=torch.float64)  # each output: its row's sum
    for impl in ("quadratic", "linear"):
        fast = make("cosformer", max_len=16, impl=impl, chunk_size=4)
        for causal in (True, False):
            torch.testing.assert_close(fast(q, k, ones, causal=causal), ones)


def test_cosformer_is_refused_where_queries_and_keys_have_no_common_positions(tmp_path):
    from transformers_lab.config import compose_config
    from transformers_lab.errors import ConfigError
    from transformers_lab.models import Transformer
    from transformers_lab.nn import MultiHeadAttention
    from transformers_lab.run.preflight import check_config

    with pytest.raises(ValueError, match="attention=cosformer weighs keys by their positions"):
        MultiHeadAttention(16, 2, "cosformer", cross=True)
    with pytest.raises(ValueError, match="model.cross_attention=..."):
        Transformer(10, 10, d_model=16, n_head=2, attention="cosformer")
    Transformer(10, 10, d_model=16, n_head=2, attention="cosformer", cross_attention="softmax")
    overrides = ["model=transformer", "data=multi30k", "attention=cosformer"]
    with pytest.raises(ConfigError, match="cosformer weighs keys by their positions in one"):
        check_config(compose_config("train", overrides, tmp_path / "a"))
    short = ["experiment=baby_gpt", "attention=cosformer", "attention.max_len=32"]
    with pytest.raises(ConfigError, match="max_len=32, but the GPT's context is 64; give"):
        check_config(compose_config("train", short, tmp_path / "b"))


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
    kernel = CosineAttention(head_dim=D, n_head=H)
    torch.testing.assert_close(kernel.tau(), torch.full((H, 1, 1), 10.0))
    with torch.no_grad():
        kernel.log_tau.fill_(20.0)
    torch.testing.assert_close(kernel.tau(), torch.full((H, 1, 1), 100.0))
    assert kernel.log_tau.shape == (H, 1, 1)


def test_additive_parameters_are_sized_by_head_dim():
    kernel = AdditiveAttention(head_dim=D, n_head=H, attn_dim=6)
    assert kernel.w_q.shape == (H, D, 6) and kernel.w_k.shape == (H, D, 6)
    assert kernel.w.shape == (H, 6) and kernel.b.shape == (H, 6)
    assert AdditiveAttention(head_dim=D, n_head=H).w.shape == (H, D)


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
    reference = kernel.reference_weights(q, k, causal=True, key_padding_mask=mask) @ v
    torch.testing.assert_close(out, reference)
    weights = torch.randn_like(out)  # a loss that weighs every output differently
    got = torch.autograd.grad((out * weights).sum(), [q, k, v, *params])
    want = torch.autograd.grad((reference * weights).sum(), [q, k, v, *params])
    names = ["q", "k", "v", *dict(kernel.named_parameters())]
    for name, a, b in zip(names, got, want, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_dropout_acts_in_training_only(name):
    if issubclass(KERNELS[name], GatedKernel):  # a recurrent state: no weights to drop
        with pytest.raises(ValueError, match=f"{name}: dropout=0.5 is not supported"):
            make(name, dropout=0.5)
        return
    kernel = make(name, dropout=0.5)
    q, k, v = qkv(6, 6, qk=kernel.qk_dim)
    # a causal-only kernel (FoX) is called causally, with its gate inputs
    kw = dict(causal=True, **kernel.sample_gates(B, 6, q.dtype)) if kernel.causal_only else {}
    eval_out = kernel(q, k, v, **kw)
    torch.testing.assert_close(kernel(q, k, v, **kw), eval_out)
    kernel.train()
    assert not torch.allclose(kernel(q, k, v, **kw), eval_out)


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


# ---------------------------------------------------------------- bad input


def test_unknown_kernel_name_lists_the_valid_ones():
    message = "unknown attention kernel 'flash'; valid kernels are: .*fastmax.*softmax"
    with pytest.raises(ValueError, match=message):
        build_kernel("flash", head_dim=D, n_head=H)


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
    q, k, v = qkv(4, 5 * kernel.keys_per_token, qk=kernel.qk_dim)  # 5 tokens of keys
    with pytest.raises(ValueError, match=r"must have shape \(batch, keys\) = \(2, 5\)"):
        kernel(q, k, v, key_padding_mask=torch.zeros(B, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be a bool tensor"):
        kernel(q, k, v, key_padding_mask=torch.zeros(B, 5))


def test_unsupported_p_and_negative_p1_are_refused():
    with pytest.raises(
        ValueError, match=r"unsupported Taylor order p=3; supported orders are \(1, 2\)"
    ):
        FastmaxAttention(head_dim=D, n_head=H, p=3)
    with pytest.raises(ValueError, match="p=1 gives negative attention weights"):
        FastmaxAttention(head_dim=D, n_head=H, p=1, normalize=False)
    with pytest.raises(ValueError, match="p=1 gives negative attention weights"):
        FastmaxAttention(head_dim=D, n_head=H, p=1, scale=2.0)
    with pytest.raises(ValueError, match="unknown impl"):
        FastmaxAttention(head_dim=D, n_head=H, impl="cuda")


@pytest.mark.parametrize("p", [1, 2])
def test_fastmax_auto_takes_the_cheaper_exact_path(p, monkeypatch):
    from transformers_lab.attention import feature_map as fm
    from transformers_lab.attention.feature_map import feature_kernel as fm_kernel

    kernel = make("fastmax", p=p)  # impl=auto
    dim = fm.feature_dim(D, p)
    assert kernel.path(dim) == "quadratic" and kernel.path(dim + 1) == "linear"
    taken = []
    for name in ("quadratic", "chunked_causal"):
        real = getattr(fm_kernel, name)
        monkeypatch.setattr(
            fm_kernel, name, lambda *a, _f=real, _n=name, **kw: taken.append(_n) or _f(*a, **kw)
        )
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


def test_a_kernel_that_sets_the_old_linear_flag_is_read_as_constant_state(caplog):
    """``linear`` was the flag's name: a user's kernel that still sets it keeps its meaning
    (what the conformance check and the generation bench read), with a note to rename."""
    from transformers_lab.attention.sliding_window import SlidingWindowAttention

    with caplog.at_level("WARNING"):

        class OldFlag(SlidingWindowAttention, register=False):
            linear = False

    assert OldFlag.constant_state is False and SlidingWindowAttention.constant_state is True
    assert "OldFlag sets linear; the kernel contract now calls it constant_state" in caplog.text
