"""Tiny checkpoints for the tests of the generation entry points (test_sample.py,
test_translate.py): fake data, and a GPT or a Transformer trained a few steps on it (the
fixtures of tests/conftest.py: each test module gets its own)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from transformers_lab.config import compose_config
from transformers_lab.run.fit import train

from fake_data import TEXT, tiny_ranks, write_multi30k, write_ranks, write_text_root

QUIET = [
    "logger=none",
    "callbacks.lr_monitor=null",
    "test=false",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
TINY_GPT = ["model=gpt", "model.n_layer=1", "model.d_model=16", "model.n_head=2"]
TINY_GPT += ["data.block_size=16", "data.train_samples=32", "task.sample_tokens=0"]
TINY_GPT += ["trainer.max_steps=2"]
# a tiny Transformer on word tokens learns the two fake pairs by heart in 30 steps
TINY_TRANSFORMER = [
    "model=transformer",
    "data=multi30k",
    "data.tokenizer=word",
    "data.min_freq=1",
    "data.block_size=32",
    "data.batch_size=8",
    "data.bucket=0",
    "model.d_model=32",
    "model.n_head=2",
    "model.n_encoder_layers=1",
    "model.n_decoder_layers=1",
    "model.dropout=0",
    "task.bleu_batches=0",
    "optimizer.lr=3e-3",
    "scheduler.warmup_steps=5",
    "trainer.max_steps=30",
]


@contextmanager
def fake_generation_data(root: Path) -> Iterator[Path]:
    """Fake Tiny Shakespeare and Multi30k, and a tiny tiktoken ranks file, in ``root``: the
    data dir (TLAB_DATA_DIR) while the context lasts."""
    with pytest.MonkeyPatch.context() as mp:
        write_text_root(root, mp, TEXT * 3)
        write_multi30k(root, mp, repeat=4)
        write_ranks(tiny_ranks(), root / "tiny.tiktoken")
        mp.setenv("TLAB_DATA_DIR", str(root))
        mp.delenv("TLAB_ROOT", raising=False)
        yield root


def trained(data_root: Path, overrides: list[str], name: str) -> Path:
    """The last checkpoint of a run beside ``data_root``, one run dir per data dir."""
    run_dir = data_root.parent / f"{data_root.name}_{name}"
    train(compose_config("train", [*QUIET, *overrides], run_dir))
    return run_dir / "checkpoints" / "last.ckpt"


def gpt_checkpoint(data_root: Path) -> Path:
    return trained(data_root, [*TINY_GPT, "data=shakespeare_char"], "gpt_char")


def rope_gpt_checkpoint(data_root: Path) -> Path:
    rope = ["data=shakespeare_char", "model.pos_encoding=rope"]
    return trained(data_root, [*TINY_GPT, *rope], "gpt_rope")


def bpe_gpt_checkpoint(data_root: Path) -> Path:
    bpe = ["data=shakespeare_bpe", "data.encoding=tiny", f"data.bpe_file={data_root}/tiny.tiktoken"]
    return trained(data_root, [*TINY_GPT, *bpe], "gpt_bpe")


def transformer_checkpoint(data_root: Path) -> Path:
    return trained(data_root, TINY_TRANSFORMER, "transformer")
