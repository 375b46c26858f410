"""A sweep's kernels scored together on the harness's tasks (``tlab-eval sweep_dir=...``,
``sweeps.harness``): each kernel at its best rate by the sweep's monitored metric, the
scores in each scored job's record and in the sweep's ``harness.md``, ``harness.csv``
and summary."""

from __future__ import annotations

import csv
import json
from itertools import product

import pytest

from transformers_lab.config import compose_config
from transformers_lab.run.job import run_job
from transformers_lab.run.record import RESULT_FILE

from fake_data import HARNESS_TASKS, write_task_corpus


@pytest.mark.slow  # four tiny runs, the harness's index (7 s) and two harness runs
def test_each_kernel_is_scored_at_its_best_rate(tmp_path):
    from transformers_lab.eval import evaluate
    from transformers_lab.train import fit_as_trial

    corpus = write_task_corpus(tmp_path)
    tiny = ["model=gpt", "model.n_layer=1", "model.d_model=16", "model.n_head=2"]
    tiny += ["data=corpus", f"data.sources=[{corpus}]", "data.tokenizer=char"]
    tiny += ["data.block_size=16", "data.split=tail", "data.val_fraction=0.3"]
    tiny += ["data.train_samples=32", "task.sample_tokens=0", "trainer.max_steps=4"]
    tiny += ["logger=csv", "test=false", "callbacks.lr_monitor=null", "seed=0"]
    sweep = tmp_path / "sweep"
    grid = list(product(["softmax", "gla"], ["1e-4", "3e-2"]))
    for i, (kernel, lr) in enumerate(grid):
        overrides = [*tiny, f"attention={kernel}", f"optimizer.lr={lr}"]
        cfg = compose_config("train", overrides, sweep / str(i))
        (sweep / str(i) / ".hydra").mkdir(parents=True, exist_ok=True)
        (sweep / str(i) / ".hydra" / "overrides.yaml").write_text(
            "".join(f"- {o}\n" for o in [f"attention={kernel}", f"optimizer.lr={lr}"])
        )
        run_job(cfg, fit_as_trial)
    losses = {
        i: json.loads((sweep / str(i) / RESULT_FILE).read_text())["metrics"]["val/loss"]
        for i in range(len(grid))
    }
    best = {
        k: min((i for i in losses if grid[i][0] == k), key=losses.get) for k in ("softmax", "gla")
    }

    options = ["harness.tasks=[tlab_choice]", f"harness.include_path={HARNESS_TASKS}"]
    evaluate(compose_config("eval", [f"sweep_dir={sweep}", *options], tmp_path / "eval"))

    for i in range(len(grid)):
        scored = i in best.values()
        assert (sweep / str(i) / "harness.json").is_file() == scored, i
        metrics = json.loads((sweep / str(i) / RESULT_FILE).read_text())["metrics"]
        assert ("harness/tlab_choice/acc" in metrics) == scored
    table = (sweep / "harness.md").read_text()
    assert "tlab_choice/acc" in table and "attention=softmax" in table and "attention=gla" in table
    rows = list(csv.DictReader((sweep / "harness.csv").read_text().splitlines()))
    won = {row["choice"]: row["best optimizer.lr"] for row in rows}
    assert won == {f"attention={k}": grid[i][1] for k, i in best.items()}
    summary = list(csv.DictReader((sweep / "summary.csv").read_text().splitlines()))
    assert "harness/tlab_choice/acc" in summary[0]
