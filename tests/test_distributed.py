"""DDP on the CPU (trainer=ddp_cpu: 2 processes over gloo): one run dir, and metrics of
the whole split whatever the number of processes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_lab.builders import compose_config
from transformers_lab.eval import evaluate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("ddp")
    run_dir = root / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(root)}
    command = [
        sys.executable, "-m", "transformers_lab.train", "trainer=ddp_cpu",
        "trainer.max_epochs=2", "logger=csv", "trainer.enable_progress_bar=false",
        "model.d_model=32", "model.n_layer=1", "model.n_head=2", "test=false",
        # 200 validation digits: split evenly over 2 processes, so no sample is repeated
        "data.val_fraction=0.1113", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done


def test_ddp_cpu_writes_one_run_dir_and_logs_the_metric_of_the_whole_split(ddp_run, tmp_path):
    run_dir, done = ddp_run
    # one run dir: the second process writes nowhere else
    assert not (run_dir.parent / "logs").exists()
    assert done.stdout.count(f"run dir: {run_dir}") == 2  # each process names the same one
    with open(run_dir / "csv" / "metrics.csv") as f:
        logged = [float(r["val/acc"]) for r in csv.DictReader(f) if r.get("val/acc")]
    assert len(logged) == 2
    # both processes report the same final accuracy: the whole split's, not their half's
    finals = [line for line in done.stdout.splitlines() if line.strip().startswith("val/acc:")]
    assert len(finals) == 2 and finals[0] == finals[1]
    # one process evaluating the best weights gets the accuracy rank 0 logged for them
    best = run_dir / "checkpoints" / "best.ckpt"
    cfg = compose_config("eval", [f"ckpt_path={best}", "logger=csv"], tmp_path / "eval")
    assert evaluate(cfg)["val/acc"] == pytest.approx(max(logged), abs=1e-6)


@pytest.mark.xfail(
    strict=True,
    reason="known bug: under ddp_cpu, last.ckpt is not rewritten after the first epoch "
    "(it holds epoch 0, step 21 of 42); single-process runs are right",
)
def test_ddp_cpu_last_checkpoint_holds_the_final_state(ddp_run):
    run_dir, _ = ddp_run
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 42  # 2 epochs of 1328 digits / (2 processes x 32)
