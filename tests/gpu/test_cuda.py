"""Every kernel on CUDA: the contract, bf16 autocast, GPT training steps, fla's kernels.

Marked ``gpu`` and skipped where no CUDA GPU is visible (CI, a laptop): ``make test-gpu``
runs them on a GPU machine. Each test compares the GPU against the float64 CPU reference
of the same weights and inputs, by the relative error ``|a - b| / |b|`` over the whole
tensor (the Frobenius norm); fp32 on CUDA lands far under 1e-3, bf16 near 1e-2.

With ``TLAB_GPU_LOG=FILE`` each test appends the errors it measured, one JSON line a test,
for the docs' table (``docs/benchmarks.md``, "On a GPU").
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import get_class, instantiate

from transformers_lab.attention import backends
from transformers_lab.attention.resolve import kernel_factory
from transformers_lab.attention.testbed import modes
from transformers_lab.check import main as check_main
from transformers_lab.config import attention_configs, compose_config
from transformers_lab.nn.multihead import MultiHeadAttention
from transformers_lab.nn.parts import split_layer_parts
from transformers_lab.run.components import build_model, compile_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible"),
]

CONFIGS = attention_configs()  # every option of conf/attention, composed once
OPTIONS = sorted(CONFIGS)
# (option, fused backend): every fused kernel of every option it covers
FUSED = [
    (name, backend)
    for name, c in sorted(CONFIGS.items())
    for backend in get_class(c["_target_"]).fused_backends
    if backend != "triton" or c.get("p") == 2  # our Triton kernel: fastmax p=2's
]
FP32_TOL, BF16_TOL = 1e-3, 5e-2
FUSED_FP32_TOL = 1e-2  # a Triton kernel's fp32 products may be tf32
D_MODEL, HEADS, N = 128, 4, 48  # head_dim 32: fla takes it


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor, in float64 on the CPU."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def record(test: str, **fields: object) -> None:
    if path := os.environ.get("TLAB_GPU_LOG"):
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **fields}) + "\n")


def grads(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gradients of x and of every parameter, flattened into one vector."""
    return torch.cat(
        [(torch.zeros_like(t) if t.grad is None else t.grad).flatten().double().cpu()
         for t in (x, *module.parameters())]
    )  # fmt: skip


# ------------------------------------------------------------------ the contract on CUDA


@pytest.mark.parametrize("name", OPTIONS)
def test_the_kernel_contract_holds_on_cuda(name, capsys):
    """``tlab-check NAME --device cuda``: every check of the contract, the layer's
    included, in float64 on the GPU."""
    status = check_main([name, "--device", "cuda"])
    out = capsys.readouterr()
    record("check", kernel=name, status=status, out=(out.out + out.err).strip()[-400:])
    assert status == 0, out.out + out.err


# ------------------------------------------------------------------ the layer in bf16


def layer_and_inputs(name: str, **options: object):
    factory = kernel_factory(name, dict(options))
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, HEADS, factory)
    with torch.no_grad():  # parameters off their initial values (zeros, ones)
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    causal = True in modes(layer.kernel)
    return layer, torch.randn(2, N, D_MODEL), causal


def run_layer(layer, x, causal, autocast: bool):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x, causal=causal)
    out.float().pow(2).mean().backward()
    return out, grads(layer, x)


@pytest.mark.parametrize("name", OPTIONS)
def test_a_layer_on_cuda_matches_float64_in_fp32_and_under_bf16_autocast(name):
    layer, x, causal = layer_and_inputs(name)
    ref = copy.deepcopy(layer).double()
    want, want_grad = run_layer(ref, x.double(), causal, autocast=False)
    errors = {}
    for precision in ("fp32", "bf16"):
        gpu = copy.deepcopy(layer).cuda()
        out, grad = run_layer(gpu, x.cuda(), causal, autocast=precision == "bf16")
        assert out.is_cuda and torch.isfinite(out).all() and torch.isfinite(grad).all()
        errors[precision] = (rel(out, want), rel(grad, want_grad))
    record("layer", kernel=name, causal=causal, errors=errors)
    kernel = layer.kernel
    fused = kernel.fused_backends and backends.choose(kernel.backend, kernel.fused_backends,
                                                      torch.device("cuda"))  # fmt: skip
    assert max(errors["fp32"]) < (FUSED_FP32_TOL if fused else FP32_TOL), errors
    assert max(errors["bf16"]) < BF16_TOL, errors


@pytest.mark.parametrize("name", OPTIONS)
def test_layer_decode_on_cuda_under_bf16_matches_the_float64_forward(name):
    layer, x, causal = layer_and_inputs(name)
    if not causal or not hasattr(layer, "decode"):
        pytest.skip(f"{name} is not causal: nothing to decode")
    with torch.no_grad():
        want = copy.deepcopy(layer).double()(x.double(), causal=True)
        gpu, xs = copy.deepcopy(layer).cuda(), x.cuda()
        errors = {}
        for precision in ("fp32", "bf16"):
            state, outs = None, []
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                for t in range(N):
                    out, state = gpu.decode(xs[:, t : t + 1], state)
                    outs.append(out)
            errors[precision] = rel(torch.cat(outs, 1), want)
    record("decode", kernel=name, errors=errors)
    assert errors["fp32"] < FP32_TOL and errors["bf16"] < BF16_TOL, errors


# ------------------------------------------------------------------ a GPT training step


class Sizes:
    """What the data would give the model: a vocabulary and a context."""

    def model_kwargs(self):
        return {"vocab_size": 96, "block_size": 128}


def gpt(name: str, tmp_path) -> torch.nn.Module:
    cfg = compose_config(
        "train",
        [f"attention={name}", "model=gpt", "model.n_layer=2", "model.n_head=4",
         "model.d_model=64"],
        tmp_path,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_model(cfg.model, Sizes())


def causal_options() -> list[str]:
    """The options a GPT can take: those whose kernels do not refuse a causal call."""
    kernels = {name: split_layer_parts(instantiate(CONFIGS[name]))[0] for name in OPTIONS}
    return [
        name for name, factory in kernels.items()
        if not factory(head_dim=16, n_head=4).causal_refusal()
    ]  # fmt: skip


def loss_and_step(model, idx, autocast: bool) -> tuple[float, float]:
    """The loss of one batch, and the loss of the same batch after one AdamW step on it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())

    before = loss()
    before.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    with torch.no_grad():
        return before.item(), loss().item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", causal_options())
def test_a_gpt_training_step_in_bf16_mixed_matches_fp32(name, compiled, tmp_path):
    """One AdamW step of a 2-layer GPT on CUDA under bf16 autocast (what ``trainer=gpu``'s
    bf16-mixed runs), eager and through ``torch.compile`` (``compile=true``), against the
    same step in fp32, eager: the losses are finite, the first within 0.05 of fp32's (an
    untrained model's loss is ln 96 = 4.56), and the step lowers the loss."""
    base = gpt(name, tmp_path)
    idx = torch.randint(0, 96, (4, 129), device="cuda")
    fp32 = loss_and_step(copy.deepcopy(base).cuda(), idx, autocast=False)
    model = copy.deepcopy(base).cuda()
    if compiled:
        said = compile_model(model)
        assert "runs through torch.compile" in said, said
    bf16 = loss_and_step(model, idx, autocast=True)
    record("gpt_step", kernel=name, compiled=compiled, fp32=fp32, bf16=bf16)
    assert all(map(math.isfinite, (*fp32, *bf16))), (fp32, bf16)
    assert abs(bf16[0] - fp32[0]) < 0.05, (fp32, bf16)
    assert bf16[1] < bf16[0] and fp32[1] < fp32[0], (fp32, bf16)


def test_tlab_train_runs_on_the_gpu_in_bf16_mixed(tmp_path, monkeypatch):
    """The real path: ``tlab-train trainer=gpu`` (one GPU, bf16-mixed) on Shakespeare's
    characters (the tests' small stand-in), with a gated kernel."""
    from transformers_lab.run.fit import train

    from fake_data import fake_data_root

    fake_data_root(tmp_path / "data", monkeypatch)
    cfg = compose_config(
        "train",
        ["experiment=baby_gpt", "trainer=gpu", "attention=gla", "trainer.max_steps=20",
         "trainer.val_check_interval=10", "data.batch_size=8", "data.block_size=64",
         "logger=csv", "trainer.enable_progress_bar=false"],
        tmp_path / "run",
    )  # fmt: skip
    metrics = train(cfg)
    record("tlab_train", metrics={k: float(v) for k, v in metrics.items()})
    assert metrics and all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())


# ------------------------------------------------------------------ fla's kernels


@pytest.mark.parametrize(("name", "backend"), FUSED)
def test_every_fused_backend_equals_our_loop_in_bf16(name, backend):
    """``attention.backend=fla`` / ``flex``: the fused kernel gives our loop's output and
    gradients in the layer (the input's and every parameter's) under bf16 autocast, and in
    fp32 where it runs fp32 (fla's delta rule without a decay does not: refused in one
    line; ``auto`` takes our loop there)."""
    if why := backends.unavailable(backend):
        pytest.skip(why)
    layer, x, _ = layer_and_inputs(name, backend="loop")
    ours = copy.deepcopy(layer).cuda()
    theirs = copy.deepcopy(layer).cuda()
    theirs.kernel.backend = backend
    delta = set(layer.kernel.gate_inputs) == {"beta"}  # the delta rule without a decay
    precisions = ("fp32", "bf16")
    if delta and backend == "fla":
        with pytest.raises(ValueError, match="fla's delta rule runs in bf16 or fp16 only"):
            run_layer(theirs, x.cuda(), True, autocast=False)
        theirs.zero_grad()
        precisions = ("bf16",)
    errors = {}
    for precision in precisions:
        want, want_grad = run_layer(ours, x.cuda(), True, autocast=precision == "bf16")
        got, got_grad = run_layer(theirs, x.cuda(), True, autocast=precision == "bf16")
        errors[precision] = (rel(got, want), rel(got_grad, want_grad))
        ours.zero_grad(), theirs.zero_grad()
    record("fused_backend", kernel=name, backend=backend, errors=errors)
    assert max(errors["bf16"]) < BF16_TOL, errors
    assert "fp32" not in errors or max(errors["fp32"]) < FUSED_FP32_TOL, errors
