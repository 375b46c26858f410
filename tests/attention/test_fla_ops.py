"""fla's kernels behind the gated recurrence, and the GPU bench's variants: what a machine
without a GPU can check (the GPU side is tests/gpu/)."""

from __future__ import annotations

import pytest
import torch

from transformers_lab.attention import build_kernel
from transformers_lab.attention.linear import fla_ops
from transformers_lab.bench import kernels as bench
from transformers_lab.config import attention_configs

GATED = sorted(name for name, c in attention_configs().items() if "backend" in c)
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")


@pytest.mark.parametrize("name", GATED)
def test_a_gated_kernel_trains_on_our_chunk_loop_unless_told(name):
    assert len(GATED) == 5
    kernel = build_kernel(name, head_dim=8, num_heads=2)
    assert kernel.backend is None and "backend=None" in repr(kernel)


def test_an_unknown_backend_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^gla: backend='triton' is not one of null, fla;"):
        build_kernel("gla", head_dim=8, num_heads=2, backend="triton")


@no_cuda
def test_the_fla_backend_without_cuda_is_refused_when_the_kernel_is_built():
    with pytest.raises(ValueError) as info:
        build_kernel("deltanet", head_dim=8, num_heads=2, backend="fla")
    message = str(info.value)
    assert "\n" not in message
    assert "attention.backend=fla cannot run here: no CUDA GPU" in message
    assert message.endswith("use attention.backend=null")


def test_fla_refuses_cpu_tensors_in_one_line():
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="runs on CUDA only, got tensors on cpu"):
        fla_ops.fla_recurrence(q, q, q, scale=0.5)


def test_the_bench_names_fla_variants_for_the_gated_kernels_and_leaves_them_out_by_default():
    found = bench.variants()
    fla = {name for name in found if name.endswith(bench.FLA)}
    assert fla == {f"{name}_fla" for name in GATED} | {"linear_fla", "based_fla"}
    for name in GATED:
        assert found[f"{name}_fla"] == {**found[name], "backend": "fla"}
    assert not fla & set(bench.default_variants())


def test_measuring_in_process_turns_failures_into_rows_and_slow_variants_stop(monkeypatch):
    spec = bench.Spec(variant="softmax", causal=True, n=64)

    def broken(_spec):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(bench, "measure_once", broken)
    row = bench.measure_here(spec, timeout=60)
    assert row["status"] == "error: RuntimeError: CUDA out of memory"
    assert not bench.too_slow(row, spec, timeout=60)

    monkeypatch.setattr(bench, "measure_once", lambda s: s.row(time_ms=5000.0, peak_mib=1.0))
    row = bench.measure_here(spec, timeout=60)
    assert row["status"] == "ok" and row["time_ms"] == 5000.0  # a slow row keeps its figure
    assert not bench.too_slow(row, spec, timeout=60)  # 5 passes of 5 s: 25 s
    assert bench.too_slow(row, spec, timeout=20)  # the variant's longer N is left out


def test_a_checkpoint_saved_before_the_option_existed_still_resumes():
    from transformers_lab.run.checkpoints import RESUME_MAY_CHANGE, differences

    new = attention_configs(names=["gla"])["gla"]
    old = {key: value for key, value in new.items() if key != "backend"}
    assert new["backend"] is None
    assert differences({"attention": old}, {"attention": new}) == []
    fla = {"attention": {**new, "backend": "fla"}}
    assert differences({"attention": old}, fla) == ["attention.backend: (absent) -> 'fla'"]
    # the same recurrence either way: a run trained on fla resumes on our loop (a CPU)
    saved, here = {"model": {"attention": fla["attention"]}}, {"model": {"attention": new}}
    assert differences(saved, here, RESUME_MAY_CHANGE) == []
