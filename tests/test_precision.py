"""Mixed precision and compilation: bf16 autocast on the CPU stays within tolerance of
float32 for every kernel and a whole model, fastmax and additive keep their sums in
float32, ``trainer.precision=bf16-mixed`` trains, and ``compile=true`` compiles or falls
back to eager mode, saying so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import KERNELS, build_kernel
from transformers_lab.config import compose_config
from transformers_lab.models import GPT
from transformers_lab.run.fit import train

B, H, N, D = 2, 2, 64, 16
# bf16 keeps 8 bits of mantissa (relative step 2^-8 = 0.004); kernels with a softmax or
# a long sum lose a few of them
BF16 = {"rtol": 0.05, "atol": 0.05}
SMALL = [
    "logger=csv",
    "model.d_model=32",
    "model.n_layer=1",
    "model.n_head=2",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=10",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "test=false",
]


def autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("causal", [False, True])
def test_every_kernel_under_bf16_autocast_is_close_to_float32(name, causal):
    kernel = build_kernel(name, head_dim=D, n_head=H)
    if not causal and kernel.causal_only:
        pytest.skip(f"{name} is causal only")
    steps = N * kernel.keys_per_token  # Gated DeltaProduct's n_h keys a token
    q, k, v = torch.randn(B, H, N, D), torch.randn(B, H, steps, D), torch.randn(B, H, steps, D)
    if kernel.unit_keys:  # the delta rule: unit keys, as its layer gives it
        k = torch.nn.functional.normalize(k, dim=-1)
    gates = kernel.sample_gates(B, N)
    expected = kernel(q, k, v, causal=causal, **gates)
    with autocast():
        low = {name: g.bfloat16() for name, g in gates.items()}
        out = kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal, **low)
    assert out.dtype in (torch.bfloat16, torch.float32)
    torch.testing.assert_close(out.float(), expected, **BF16)


def test_additive_scores_are_summed_in_float32_under_autocast():
    kernel = build_kernel("additive", head_dim=D, n_head=H)
    q, k = (torch.randn(B, H, N, D).bfloat16() for _ in range(2))
    with autocast():
        scores = kernel.scores(q, k)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, kernel.scores(q.float(), k.float()))


def test_fastmax_states_are_float32_under_autocast():
    kernel = build_kernel("fastmax", head_dim=D, n_head=H, p=2)
    q, k, v = (torch.randn(B, H, N, D).bfloat16() for _ in range(3))
    with autocast():
        _, state = kernel.decode(q, k, v)
    assert state.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_gpt_under_bf16_autocast_has_the_float32_loss(name):
    torch.manual_seed(0)
    model = GPT(vocab_size=50, block_size=N, d_model=32, n_layer=2, n_head=2, attention=name)
    x = torch.randint(50, (B, N))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())
    with autocast():
        low = F.cross_entropy(model(x).float().flatten(0, 1), x.roll(-1, 1).flatten())
    assert low.item() == pytest.approx(loss.item(), rel=0.02)


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> dict[str, float]:
    return train(compose_config("train", SMALL, tmp_path_factory.mktemp("eager") / "run"))


def test_bf16_mixed_trains_on_the_cpu_as_float32_does(tmp_path, eager):
    overrides = [*SMALL, "trainer.precision=bf16-mixed"]
    metrics = train(compose_config("train", overrides, tmp_path / "run"))
    assert metrics["val/loss"] == pytest.approx(eager["val/loss"], rel=0.02)


def test_bf16_mixed_clips_the_gradients_of_the_fused_optimizer_preset(tmp_path, caplog):
    # Lightning refuses to clip a fused step under mixed precision: the task builds the
    # per-tensor step instead (a RuntimeError at the first step before)
    overrides = [*SMALL, "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=0.5"]
    cfg = compose_config("train", overrides, tmp_path / "run")
    assert cfg.optimizer.fused is True
    with caplog.at_level("INFO", logger="transformers_lab.tasks.base"):
        metrics = train(cfg)
    assert torch.isfinite(torch.tensor(metrics["val/loss"]))
    assert "optimizer.fused=true is set aside" in caplog.text


def test_compile_falls_back_to_eager_mode_and_says_so(tmp_path, monkeypatch, capsys, eager):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(torch, "compile", no_compiler)
    metrics = train(compose_config("train", [*SMALL, "compile=true"], tmp_path / "run"))
    out = capsys.readouterr().out
    assert (
        "compile=true: torch.compile is unavailable here (RuntimeError: no C++ compiler "
        "found); training in eager mode"
    ) in out
    assert metrics == eager  # eager mode: the very same run


@pytest.mark.slow
def test_compile_true_trains_the_compiled_model(tmp_path, monkeypatch, eager):
    compiled = []
    real = torch.nn.Module.compile

    def compile_(module, *args, **kwargs):
        compiled.append(module)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_)
    metrics = train(compose_config("train", [*SMALL, "compile=true"], tmp_path / "compiled"))
    assert len(compiled) == 1 and compiled[0]._compiled_call_impl is not None
    # the same training up to the compiler's float reordering
    assert metrics["val/loss"] == pytest.approx(eager["val/loss"], abs=1e-3)
