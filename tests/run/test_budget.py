"""A run budgeted in tokens (run/budget.py), its throughput and MFU in the logs
(run/callbacks/throughput.py), and the FLOPs a token they count (each kernel's own)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from transformers_lab.attention import build_kernel
from transformers_lab.config import compose_config
from transformers_lab.errors import ConfigError
from transformers_lab.models.gpt import GPT
from transformers_lab.run import budget
from transformers_lab.run.callbacks.throughput import Throughput, known_peak, peak_of
from transformers_lab.run.fit import fit_and_test

from fake_data import fake_data_root


def trainer(**given):
    return OmegaConf.create({"max_steps": -1, "accumulate_grad_batches": 1, **given})


# ------------------------------------------------------------------ the plan


def test_a_budget_ends_at_its_last_whole_step_and_a_batch_in_tokens_accumulates():
    # 8 windows of 64 tokens on 2 processes: 1024 tokens a micro-batch
    plan = budget.plan(trainer(max_tokens=10_000, batch_tokens=4096), 64, 8, 2)
    assert (plan.accumulate, plan.step_tokens, plan.max_steps) == (4, 4096, 2)
    plan = budget.plan(trainer(max_tokens=15e9, batch_tokens=2**19), 2048, 16, 16)
    assert (plan.accumulate, plan.max_steps) == (1, 28610)  # GLA's 15B tokens in 0.5M batches
    plan = budget.plan(trainer(max_tokens=8192), 64, 8, 2)  # the trainer's accumulation
    assert (plan.accumulate, plan.max_steps) == (1, 8)
    assert budget.plan(trainer(), 64, 8, 2) is None


def test_a_resumed_budget_counts_the_tokens_its_checkpoint_had():
    # 4 steps of 768 tokens done; now 1536 a step: (9216 - 3072) / 1536 = 4 steps more
    plan = budget.plan(trainer(max_tokens=9216, batch_tokens=1536), 64, 12, 1, 4, 3072)
    assert plan.max_steps == 8
    # a checkpoint of an earlier version counted no tokens: its steps at this batch
    assert budget.plan(trainer(max_tokens=9216), 64, 12, 1, 4, None).max_steps == 12
    # a budget already spent trains nothing more
    assert budget.plan(trainer(max_tokens=3000), 64, 12, 1, 4, 3072).max_steps == 4


@pytest.mark.parametrize(
    ("given", "window", "said"),
    [
        ({"max_tokens": 500}, 64, "trainer.max_tokens=500 is below one optimizer step of 1,536"),
        ({"batch_tokens": 1000}, 64, "trainer.batch_tokens=1,000 is no whole number of micro-"),
        ({"batch_tokens": 3072, "accumulate_grad_batches": 3}, 64, "disagree"),
        ({"max_tokens": 0}, 64, "trainer.max_tokens must be a whole number of tokens >= 1"),
        ({"max_tokens": 1.5}, 64, "trainer.max_tokens must be a whole number"),
        ({"max_tokens": 10_000}, None, "budget the run in trainer.max_steps"),
    ],
)
def test_a_budget_that_cannot_be_met_is_one_line(given, window, said):
    with pytest.raises(ConfigError, match=said):
        budget.plan(trainer(**given), window, 12, 2)


def test_the_processes_a_trainer_config_counts():
    assert budget.processes({"devices": 2, "num_nodes": 3, "accelerator": "cpu"}) == 6
    assert budget.processes({"devices": "auto", "accelerator": "cpu"}) == 1
    assert budget.processes({"devices": [0, 1], "accelerator": "gpu"}) == 2
    assert budget.processes({"devices": "4"}) == 4
    assert budget.processes({"devices": "0,1", "num_nodes": 2}) == 4  # indices, as a string


def test_a_token_budget_is_refused_before_any_data_is_read(tmp_path):
    cfg = compose_config(
        "train", ["experiment=baby_gpt", "trainer.max_tokens=100", "data.root=/nowhere"], tmp_path
    )
    with pytest.raises(ConfigError, match="below one optimizer step of 768 tokens"):
        fit_and_test(cfg)
    cfg = compose_config("train", ["scheduler.warmup_tokens=1000"], tmp_path)
    with pytest.raises(ConfigError, match="warmup_tokens=1000 needs the run's batch in tokens"):
        fit_and_test(cfg)


# ------------------------------------------------------------------ a run to its token


def logged(run_dir: Path, key: str) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


TINY = [
    "experiment=baby_gpt", "model.n_layer=1", "model.d_model=16", "model.n_head=2",
    "data.block_size=16", "data.batch_size=4", "logger=csv", "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "task.sample_tokens=0",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
]  # fmt: skip


def test_the_budget_ends_a_run_at_its_token_across_a_resume(tmp_path, monkeypatch):
    """4 steps of 64 tokens (256), then resumed with steps of 128 to 768 tokens: 4 steps
    more, 768 tokens in the last checkpoint; the warm-up in tokens becomes steps of each."""
    fake_data_root(tmp_path / "data", monkeypatch)
    warmup = "scheduler.warmup_tokens=128"
    peak = "callbacks.throughput.peak_tflops=0.001"  # 1 GFLOP/s: MFU is rate x FLOPs / 1e9
    first = compose_config("train", [*TINY, "trainer.max_tokens=300", warmup, peak], tmp_path / "a")
    result = fit_and_test(first)
    assert first.trainer.max_steps == 4 and first.scheduler.warmup_steps == 2
    last = torch.load(tmp_path / "a" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["global_step"], last["tlab_tokens"]) == (4, 256)
    assert logged(tmp_path / "a", "train/tokens") == [64, 128, 192, 256]
    rate = result.metrics["perf/tokens_per_s"]  # the run's means, in its result
    with torch.device("meta"):
        vocab = last["state_dict"]["model.tok.weight"].shape[0]
        model = instantiate(first.model, vocab_size=vocab, block_size=16)
    flops = model.flops_per_token(16)
    assert rate > 0 and result.metrics["perf/mfu"] == pytest.approx(rate * flops / 1e9, rel=1e-4)
    again = [
        *TINY, "trainer.max_tokens=768", "trainer.batch_tokens=128", warmup,
        f"ckpt_path={tmp_path / 'a' / 'checkpoints' / 'last.ckpt'}",
    ]  # fmt: skip
    second = compose_config("train", again, tmp_path / "b")
    fit_and_test(second)
    assert second.trainer.accumulate_grad_batches == 2 and second.scheduler.warmup_steps == 1
    last = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (last["global_step"], last["tlab_tokens"]) == (8, 768)
    assert logged(tmp_path / "b", "train/tokens") == [384, 512, 640, 768]  # a step, 2 batches


# ------------------------------------------------------------------ FLOPs and the peak


def counted(model: torch.nn.Module, tokens: int) -> int:
    x = torch.randint(0, 50, (3, tokens))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


def test_a_gpt_s_flops_a_token_are_its_products_forward_and_backward():
    # linear attention runs its linear path at every length: torch counts what we count
    model = GPT(50, 40, n_layer=2, n_head=2, d_model=32, attention="linear")
    assert counted(model, 40) == model.flops_per_token(40) * 3 * 40
    # softmax: torch's counter sees the linear layers (its CPU attention op uncounted);
    # ours adds the causal pairs' scores and their use, 6 (Dk + Dv) a pair and head
    model = GPT(50, 32, n_layer=2, n_head=2, d_model=32, attention="softmax")
    pairs = 32 * 33 // 2
    attention = 6 * (16 + 16) * pairs * 2 * 2  # heads, layers
    assert counted(model, 32) + 3 * attention == model.flops_per_token(32) * 3 * 32


def test_softmax_s_flops_a_token_grow_with_the_context_and_a_linear_kernel_s_do_not():
    per_token = {
        name: [build_kernel(name, head_dim=64, n_head=8).flops(n) / n for n in (1024, 4096)]
        for name in ("softmax", "gla", "gated_deltanet", "sliding_window")
    }
    assert per_token["softmax"][1] == pytest.approx(4 * per_token["softmax"][0], rel=1e-3)
    assert per_token["gla"][0] == per_token["gla"][1] == 3 * (2 + 2) * 64 * 64 * 8
    assert per_token["gated_deltanet"][0] == 3 * (4 + 2) * 64 * 64 * 8  # the delta rule's read
    assert max(per_token["sliding_window"]) < 6 * (64 + 64) * 64 * 8  # 64 keys at most


def test_the_peak_table_reads_the_names_torch_gives():
    assert known_peak("NVIDIA H100 80GB HBM3") == ("H100", 989e12)
    assert known_peak("NVIDIA H100 PCIe")[0] == "H100 PCIe"
    assert known_peak("NVIDIA A100-SXM4-80GB")[0] == "A100"
    assert known_peak("NVIDIA A10")[0] == "A10"
    assert known_peak("NVIDIA GH200 480GB")[0] == "GH200"
    assert known_peak("Intel Xeon") is None
    assert peak_of("auto", 0.5) == (None, 0.5e12)
    with pytest.raises(ValueError, match=r"hardware='TPU v5' is not in the table.*peak_tflops"):
        Throughput(hardware="TPU v5")


def test_an_unknown_hardware_name_is_refused_before_the_data_is_read(tmp_path):
    cfg = compose_config(
        "train",
        ["experiment=baby_gpt", "callbacks.throughput.hardware=A9000", "data.root=/no"],
        tmp_path,
    )
    with pytest.raises(ConfigError, match="hardware='A9000' is not in the table of peaks"):
        fit_and_test(cfg)


# ------------------------------------------------------------------ FSDP's settings


def test_fsdp_on_one_process_and_an_unknown_dtype_are_refused_in_one_line(tmp_path):
    from transformers_lab.run.distributed import Sharded

    cfg = compose_config("train", ["trainer=fsdp_cpu", "trainer.devices=1"], tmp_path)
    with pytest.raises(ConfigError, match="trainer=fsdp shards the model over processes, and"):
        fit_and_test(cfg)
    with pytest.raises(ValueError, match="params must be one of bf16, fp32, got 'bf8'"):
        Sharded(params="bf8")
    cfg = compose_config("train", ["trainer=fsdp_cpu", "trainer.strategy.params=bf8"], tmp_path)
    with pytest.raises(ConfigError, match="params must be one of bf16, fp32"):
        fit_and_test(cfg)


class Planted:
    """Pickled, a call of ``exec``: what a crafted index of a sharded checkpoint holds."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('ran')",))


def test_a_sharded_checkpoint_whose_index_would_run_code_is_refused(tmp_path):
    """PyTorch reads a sharded checkpoint's index with plain pickle: ours reads it with
    only the types such an index holds."""
    import pickle

    from transformers_lab.run.checkpoints.saved import read_checkpoint

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    torch.save({"global_step": 3}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(pickle.dumps(Planted()))
    with pytest.raises(ConfigError, match=r"\.metadata asks to run builtins\.exec as it loads"):
        read_checkpoint(folder)


def test_a_requeued_job_finds_a_sharded_checkpoint_a_killed_save_left_aside(tmp_path):
    """A sharded save renames the old folder aside before it moves the new one in; killed
    between the two, the job's checkpoint is at last.ckpt.old, which a requeued job resumes
    from (and the next save puts back)."""
    from omegaconf import open_dict

    from transformers_lab.run.job import resume_own_checkpoint

    aside = tmp_path / "checkpoints" / "last.ckpt.old"
    aside.mkdir(parents=True)
    cfg = compose_config("train", [], tmp_path)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        cfg.callbacks.model_checkpoint.dirpath = str(tmp_path / "checkpoints")
    resume_own_checkpoint(cfg)
    assert cfg.ckpt_path == str(aside)
