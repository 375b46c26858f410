"""DDP on the CPU (trainer=ddp_cpu: 2 processes over gloo): one run dir, metrics of the
whole split whatever the number of processes, and the same training as one process on
the combined batch."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DistributedSampler

from transformers_lab.config import compose_config
from transformers_lab.data import DigitsDataModule
from transformers_lab.data.base import ResumableLoader
from transformers_lab.eval import evaluate
from transformers_lab.run.fit import train

pytestmark = pytest.mark.slow


# float32 sums in another order (the all-reduce): measured 5e-7 on the losses and 1.2e-7
# on the weights after 42 steps
TOLERANCE = 1e-5
# 200 validation and 1328 training digits: even, so the 2 processes repeat no sample
RUN = [
    "trainer.max_epochs=2", "logger=csv", "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1", "model.d_model=32", "model.n_layer=1", "model.n_head=2",
    "test=false", "data.val_fraction=0.1113", "data.batch_size=32",
]  # fmt: skip


# this file, to import its callbacks by module name, and fake_data beside it
HERE = os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("ddp")
    run_dir = root / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(root)}
    command = [
        sys.executable, "-m", "transformers_lab.train", "trainer=ddp_cpu", *RUN,
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done


def test_ddp_cpu_writes_one_run_dir_and_logs_the_metric_of_the_whole_split(ddp_run, tmp_path):
    run_dir, done = ddp_run
    # one run dir: the second process writes nowhere else
    assert not (run_dir.parent / "logs").exists()
    # only the first process prints (and writes result.json)
    assert done.stdout.count(f"run dir: {run_dir}") == 1
    assert done.stdout.count("final metrics:") == 1
    accuracies = [acc for _, acc in logged(run_dir, "val/acc")]
    assert len(accuracies) == 2
    # one process evaluating the best weights gets the accuracy rank 0 logged for them:
    # the whole split's, not rank 0's half
    best = run_dir / "checkpoints" / "best.ckpt"
    cfg = compose_config("eval", [f"ckpt_path={best}", "logger=csv"], tmp_path / "eval")
    assert evaluate(cfg)["val/acc"] == pytest.approx(max(accuracies), abs=1e-6)


def test_ddp_cpu_last_checkpoint_holds_the_final_state(ddp_run):
    run_dir, _ = ddp_run
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 42  # 2 epochs of 1328 digits / (2 processes x 32)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    return train_one_process_on_the_combined_batch(tmp_path_factory.mktemp("one") / "run")


def train_one_process_on_the_combined_batch(run_dir: Path) -> Path:
    """``RUN`` on one process on the combined batch, into ``run_dir``: rank r's i-th batch
    is perm[64 i + r :: 2] of DistributedSampler's permutation, so one process reading
    that permutation in batches of 64 sees the union of the two ranks' batches; the mean
    of the two gradients is its gradient. (The SLURM DDP test's reference too.)"""

    def combined_batches(self: DigitsDataModule) -> ResumableLoader:
        self.setup()
        order = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True)
        return ResumableLoader(self.train_set, batch_size=64, sampler=order)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DigitsDataModule, "train_dataloader", combined_batches)
        train(compose_config("train", [*RUN, "data.batch_size=64"], run_dir))
    return run_dir


def assert_trains_as(run_dir: Path, one: Path) -> None:
    """The same losses and accuracies, logged at the same steps, as ``one``."""
    for key in ("train/loss", "val/loss", "val/acc"):
        two, ones = logged(run_dir, key), logged(one, key)
        assert [s for s, _ in two] == [s for s, _ in ones] and len(ones) >= 2
        assert [v for _, v in two] == pytest.approx([v for _, v in ones], abs=TOLERANCE), key


def assert_same_weights(two: dict, one: dict) -> None:
    for name, tensor in one.items():
        if name.endswith("qkv_proj.bias"):  # not the key bias: its true gradient is 0 (it
            # shifts a query's scores equally), so Adam turns the float noise of either
            # sum into full-size steps (measured 3e-3 apart)
            keys = slice(len(tensor) // 3, 2 * len(tensor) // 3)
            two[name][keys], tensor[keys] = 0.0, 0.0
        assert torch.allclose(two[name], tensor, atol=TOLERANCE / 10, rtol=0), name


def test_two_processes_train_as_one_process_on_the_combined_batch(ddp_run, one_process):
    run_dir, _ = ddp_run
    assert_trains_as(run_dir, one_process)
    two = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    one = torch.load(one_process / "checkpoints" / "last.ckpt", weights_only=True)
    assert_same_weights(two, one["state_dict"])


# ------------------------------------------------------------------ FSDP (FSDP2 over gloo)


class SaveRestoredWeights(L.Callback):
    """Every process gathers the whole model as training starts (after a resume's
    restore), and the first saves it to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True))
        if trainer.global_rank == 0:
            torch.save(whole, self.path)


def tlab_train(*overrides: str, pythonpath: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "transformers_lab.train", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", **({"PYTHONPATH": HERE} if pythonpath else {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """trainer=fsdp_cpu, each block recomputed in the backward pass."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    tlab_train("trainer=fsdp_cpu", *RUN, "model.activation_checkpointing=true",
               f"hydra.run.dir={run_dir}")  # fmt: skip
    return run_dir


def test_fsdp_with_activation_checkpointing_trains_as_one_process(fsdp_run, one_process, tmp_path):
    """FSDP2 in float32 over 2 CPU processes, each block sharded and recomputed: the
    losses and accuracies of one plain process on the combined batch, and its weights;
    the checkpoints are folders of both processes' parts, which tlab-eval reads whole."""
    from transformers_lab.run.checkpoints.saved import is_sharded, read_checkpoint

    assert_trains_as(fsdp_run, one_process)
    last, best = (fsdp_run / "checkpoints" / f"{k}.ckpt" for k in ("last", "best"))
    assert is_sharded(last) and len(list(last.glob("*.distcp"))) == 2
    one = torch.load(one_process / "checkpoints" / "last.ckpt", weights_only=True)
    assert_same_weights(read_checkpoint(last).state_dict, one["state_dict"])
    cfg = compose_config("eval", [f"ckpt_path={best}", "logger=csv"], tmp_path / "eval")
    assert evaluate(cfg)["val/acc"] == pytest.approx(max(a for _, a in logged(fsdp_run, "val/acc")))


def test_a_sharded_checkpoint_resumes_onto_three_processes(fsdp_run, tmp_path):
    """The 2 processes' last.ckpt read back by 3, in the field's precision (parameters
    gathered in bf16, gradients reduced in float32) and as ZeRO-2 (each block's gathered
    parameters kept from its forward pass to its backward): the whole model as the
    processes hold it once restored is the checkpoint's, and the run trains its third
    epoch on."""
    from transformers_lab.run.checkpoints.saved import read_checkpoint

    last = fsdp_run / "checkpoints" / "last.ckpt"
    restored = tmp_path / "restored.pt"
    tlab_train(
        "trainer=fsdp_cpu", "trainer.devices=3", *RUN, "trainer.max_epochs=3",
        "trainer.strategy.params=bf16", "trainer.precision=bf16-mixed",
        "trainer.strategy.reshard_after_forward=false",  # ZeRO-2
        "trainer.gradient_clip_val=1.0",  # the presets clip: a norm of sharded gradients
        f"ckpt_path={last}", f"hydra.run.dir={tmp_path / 'run'}",
        f"+callbacks.restored._target_={__name__}.{SaveRestoredWeights.__qualname__}",
        f"+callbacks.restored.path={restored}", pythonpath=True,
    )  # fmt: skip
    saved = read_checkpoint(last).state_dict
    whole = torch.load(restored, weights_only=True)
    assert set(whole) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(whole[name], tensor), name
    resumed = read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert resumed.step == 42 + -(-1328 // (3 * 32))  # an epoch more, on 3 processes
    losses = [v for _, v in logged(tmp_path / "run", "train/loss")]
    assert len(losses) == 14 and all(0 < v < 2.4 for v in losses)  # trained on, finite


class SignalTheGroupAt(L.Callback):
    """Rank 0 sends its whole process group a signal while it trains the batch that
    reaches ``step``: what Ctrl+C in a terminal, or ``kill -- -PGID``, does."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.is_global_zero and trainer.global_step == self.step - 1:
            os.killpg(os.getpgid(0), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_every_process_stops_ddp_together_with_a_checkpoint(tmp_path, signum):
    """Every process gets the signal (Lightning's own handler then broadcast from inside
    the handler, once per delivery, and the processes hung); they stop at the same step."""
    run_dir, name = tmp_path / "run", signal.Signals(signum).name
    callback = f"{__name__}.{SignalTheGroupAt.__qualname__}"
    command = [
        sys.executable, "-m", "transformers_lab.train", "trainer=ddp_cpu", *RUN,
        f"+callbacks.signal._target_={callback}", "+callbacks.signal.step=5",
        f"+callbacks.signal.signum={int(signum)}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": HERE}
    # a session of its own: the signal goes to the run's processes, not to pytest
    run = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:  # hung: leave no process behind
            os.killpg(run.pid, signal.SIGKILL)
    last = run_dir / "checkpoints" / "last.ckpt"
    assert run.returncode == 128 + signum, err[-3000:]
    assert f"stopped by {name} at global step 5: saved {last}" in err
    assert torch.load(last, weights_only=True)["global_step"] == 5


class RecordBatches(L.Callback):
    """Save the inputs of every training batch this process took, to ``<dir>/rank<r>.pt``."""

    def __init__(self, dir: str) -> None:
        self.dir, self.batches = Path(dir), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0].clone())

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(torch.cat(self.batches), self.dir / f"rank{trainer.global_rank}.pt")


def test_ddp_with_loader_workers_reads_disjoint_windows_that_the_seed_decides(tmp_path):
    """A corpus on 2 processes with 2 loader workers each: the processes share one epoch
    of ``train_samples`` windows, rank r taking positions r, r + 2, ... of the order the
    seed gives (Lightning would have swapped a RandomSampler for a DistributedSampler over
    every window: an epoch as long as the corpus)."""
    from transformers_lab.data.corpus import CorpusDataModule
    from transformers_lab.data.corpus.windows import WindowOrder

    words = ["sea", "king", "rose", "night", "fair", "crown", "war", "love"]
    docs = [" ".join(words[(i * j + j // 3) % 8] for j in range(40)) for i in range(100)]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))
    data = {"sources": [str(tmp_path / "docs.txt")], "tokenizer": "char", "block_size": 16,
            "documents": "paragraphs", "val_fraction": 0.1, "train_samples": 48,
            "prepared_dir": str(tmp_path / "prepared"), "order_seed": 5}  # fmt: skip
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "transformers_lab.train", "trainer=ddp_cpu", "model=gpt",
        "data=corpus", *(f"data.{k}={v}" for k, v in data.items()), "data.batch_size=4",
        "data.num_workers=2", "model.d_model=16", "model.n_layer=1", "model.n_head=2",
        "trainer.max_epochs=1", "trainer.limit_val_batches=2", "test=false", "logger=csv",
        "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
        f"+callbacks.record._target_={__name__}.RecordBatches", f"+callbacks.record.dir={tmp_path}",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": HERE}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 48 // (2 * 4)
    dm = CorpusDataModule(**data)
    dm.setup()
    windows = dm.train_dataloader().dataset
    for rank in (0, 1):
        order = WindowOrder(len(windows), 48, seed=5, num_replicas=2, rank=rank)
        expected = torch.stack([windows[i][0] for i in order])
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), expected)
