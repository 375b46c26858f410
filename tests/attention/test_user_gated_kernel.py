"""A gated kernel of the user's own, as docs/kernels.md writes it: ``decay_linear`` (elu + 1
features, a decay per head from x; ``tests/user/user_kernels/decay_linear.py``, its yaml in
``tests/user/my_conf/attention/``), and the hook it uses, ``GatedKernel.feature_map``: the
map reaches every path (our chunked loop, fla's op, ``weights``, the float64 reference,
``decode``), and a map to another width is refused in one line."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.end_to_end.test_readme import readme_block  # the code blocks of README and docs/
from transformers_lab.attention import REGISTRY, fla_ops
from transformers_lab.attention.deltanet import DeltaNetAttention
from transformers_lab.attention.gated.recurrence import chunked_recurrence
from transformers_lab.attention.gla import GLAAttention
from transformers_lab.attention.simple_gla import SimpleGLAAttention
from transformers_lab.check import main as check_main
from transformers_lab.config import searchpath_override

ROOT = Path(__file__).resolve().parents[2]
USER = ROOT / "tests" / "user"
MY_CONF = USER / "my_conf"
FILES = [USER / "user_kernels" / "decay_linear.py", MY_CONF / "attention" / "decay_linear.yaml"]
B, H, D, DV = 2, 2, 6, 3


@pytest.fixture
def docs_kernel(monkeypatch):
    """The docs' kernel class, imported as a user's: its folder on the path; registered
    while the test runs only (the registry's other readers see the package's kernels)."""
    monkeypatch.syspath_prepend(str(USER))
    yield importlib.import_module("user_kernels.decay_linear").DecayLinearAttention
    REGISTRY.pop("decay_linear", None)
    sys.modules.pop("user_kernels.decay_linear", None)


def test_the_docs_blocks_are_the_files_the_tests_run():
    for path in FILES:
        assert readme_block(f"# {path.relative_to(ROOT)}") == path.read_text(), path.name


def test_the_docs_kernel_passes_the_check_and_prints_what_the_docs_show(docs_kernel, capsys):
    assert check_main(["decay_linear", "--config-dir", str(MY_CONF)]) == 0
    out = capsys.readouterr().out.strip()
    assert re.match(r"ok: decay_linear passes the \d+ checks \(shapes, reference", out)
    assert f"```text\n{out}\n```" in (ROOT / "docs" / "kernels.md").read_text()


def with_map(base: type, fn) -> type:
    class Mapped(base, register=False):
        def feature_map(self, x):
            return fn(x)

    return Mapped


def elu1(x):
    return F.elu(x) + 1


def unit(x):
    return F.normalize(x, dim=-1)


def pair(case: str, docs_kernel: type):
    """(a kernel whose feature_map is fn, the same kernel without a map, fn)."""
    if case == "docs":
        return docs_kernel, with_map(docs_kernel, lambda x: x), elu1
    base, fn = {
        "simple_gla relu": (SimpleGLAAttention, torch.relu),  # a decay per head
        "gla elu+1": (GLAAttention, elu1),  # per key channel
        "deltanet l2": (DeltaNetAttention, unit),  # the delta rule
    }[case]
    return with_map(base, fn), base, fn


def build(cls: type, seed: int = 0):
    torch.manual_seed(seed)
    return cls(head_dim=D, n_head=H, chunk_size=4, backend="loop").double()


def inputs(kernel, nq: int, nk: int, padded: bool):
    torch.manual_seed(1)
    q = torch.randn(B, H, nq, D, dtype=torch.float64)
    k = torch.randn(B, H, nk, D, dtype=torch.float64)
    v = torch.randn(B, H, nk, DV, dtype=torch.float64)
    gates = kernel.sample_gates(B, nk, torch.float64)
    mask = None
    if padded:  # batch 0 padded at its start, batch 1 at its end
        mask = torch.zeros(B, nk, dtype=torch.bool)
        mask[0, :2], mask[1, -3:] = True, True
    return q, k, v, gates, mask


@pytest.mark.parametrize(
    "nq, nk, padded", [(11, 11, False), (11, 11, True), (4, 11, True), (11, 5, False)]
)
@pytest.mark.parametrize("case", ["docs", "simple_gla relu", "gla elu+1", "deltanet l2"])
def test_the_map_reaches_forward_weights_the_reference_and_decode(
    case, nq, nk, padded, docs_kernel
):
    """A kernel with a feature_map gives what the same kernel without one gives fed the
    mapped q and k, on every path; padded keys (elu + 1 of 0 is 1) still write nothing."""
    mapped_cls, plain_cls, fn = pair(case, docs_kernel)
    mapped, plain = build(mapped_cls), build(plain_cls)
    plain.load_state_dict(mapped.state_dict())
    q, k, v, gates, mask = inputs(mapped, nq, nk, padded)
    kw = dict(causal=True, key_padding_mask=mask, **gates)
    out = mapped(q, k, v, **kw)
    torch.testing.assert_close(out, plain(fn(q), fn(k), v, **kw))
    weights = mapped.weights(q, k, **kw)
    torch.testing.assert_close(weights, plain.weights(fn(q), fn(k), **kw))
    reference = mapped.reference_weights(q, k, **kw)
    torch.testing.assert_close(reference, plain.reference_weights(fn(q), fn(k), **kw))
    torch.testing.assert_close(weights, reference)
    torch.testing.assert_close(out, reference @ v)
    if nq == nk:  # decode token by token: the causal forward, and the plain kernel's state
        state = plain_state = None
        outs = []
        for t in range(nk):
            one = {name: g[:, :, t : t + 1] for name, g in gates.items()}
            step_mask = None if mask is None else mask[:, t : t + 1]
            o, state = mapped.decode(
                q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state,
                key_padding_mask=step_mask, **one,
            )  # fmt: skip
            _, plain_state = plain.decode(
                fn(q[:, :, t : t + 1]), fn(k[:, :, t : t + 1]), v[:, :, t : t + 1],
                plain_state, key_padding_mask=step_mask, **one,
            )  # fmt: skip
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, dim=2), out)
        torch.testing.assert_close(state, plain_state)


def test_the_map_is_not_applied_twice_nor_skipped(docs_kernel):
    """The comparison above can fail: a kernel fed the mapped q and k again differs."""
    mapped = build(docs_kernel)
    q, k, v, gates, _ = inputs(mapped, 9, 9, False)
    once = mapped(q, k, v, causal=True, **gates)
    assert not torch.allclose(mapped(elu1(q), elu1(k), v, causal=True, **gates), once)
    plain = build(with_map(docs_kernel, lambda x: x))
    assert not torch.allclose(plain(q, k, v, causal=True, **gates), once)


def test_fla_s_op_gets_the_mapped_q_and_k(docs_kernel, monkeypatch):
    """``backend=fla`` hands fla's op the mapped q and k: the op faked by our loop here,
    where no GPU is (test_fla_ops.py runs fla's own under Triton's interpreter)."""
    kernel = build(docs_kernel)
    q, k, v, gates, _ = inputs(kernel, 9, 9, False)
    want = kernel(q, k, v, causal=True, **gates)
    seen = {}

    def fake_fla(q, k, v, log_decay=None, beta=None, scale=None, keys_per_token=1):
        assert keys_per_token == 1
        seen.update(q=q, k=k)
        return chunked_recurrence(q, k, v, log_decay, beta, scale=scale, chunk_size=4)[0]

    monkeypatch.setattr(fla_ops, "fla_recurrence", fake_fla)
    kernel.backend = "fla"  # as if built with attention.backend=fla on a GPU
    got = kernel(q, k, v, causal=True, **gates)
    torch.testing.assert_close(seen["q"], elu1(q))
    torch.testing.assert_close(seen["k"], elu1(k))
    torch.testing.assert_close(got, want)


def test_a_map_to_another_width_is_refused_in_one_line():
    kernel = build(with_map(SimpleGLAAttention, lambda x: torch.cat([x, x.square()], -1)))
    q, k, v, gates, _ = inputs(kernel, 5, 5, False)
    calls = {
        "forward": lambda: kernel(q, k, v, causal=True, **gates),
        "weights": lambda: kernel.weights(q, k, causal=True, **gates),
        "reference_weights": lambda: kernel.reference_weights(q, k, causal=True, **gates),
        "decode": lambda: kernel.decode(q, k, v, **gates),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == (
            "simple_gla: feature_map must keep the width of q (qk_dim = 6), got 12; for 12 "
            "features set self.qk_dim = 12 in __init__ (the layer then projects x to q and k "
            "12 wide) and keep the map's width"
        ), name
    shrunk = build(with_map(SimpleGLAAttention, lambda x: x[:, :, :1]))
    with pytest.raises(
        ValueError, match=r"changed the shape of q from \(2, 2, 5, 6\) to \(2, 2, 1, 6\)"
    ):
        shrunk(q, k, v, causal=True, **gates)


def test_a_hybrid_stack_trains_with_the_docs_kernel(docs_kernel, tmp_path):
    """``model.hybrid={1: decay_linear}`` finds the kernel on the search path, as the docs
    say, and trains (one batch)."""
    from transformers_lab.config import compose_config
    from transformers_lab.run.fit import fit_and_test

    overrides = [
        "experiment=mqar", "attention=softmax", "model.hybrid={1: decay_linear}", "debug=fdr",
        "logger=csv", *searchpath_override([MY_CONF]),
    ]  # fmt: skip
    outcome = fit_and_test(compose_config("train", overrides, tmp_path / "run"))
    assert outcome.layers == ["softmax", "decay_linear(output_norm=True)"]
