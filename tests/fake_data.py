"""Small stand-ins for the real data sets, written by the tests into a scratch root, with
the pinned checksums patched to match (so the real verification code runs on them)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from transformers_lab.data import (
    FashionMNISTDataModule,
    MNISTDataModule,
    ShakespeareCharDataModule,
)
from transformers_lab.data import translation as translation_module

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20
PAIRS = [("A man rides a horse.", "Ein Mann reitet ein Pferd."), ("Two dogs.", "Zwei Hunde.")]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_text_root(root: Path, monkeypatch: pytest.MonkeyPatch, text: str = TEXT) -> Path:
    """``<root>/shakespeare/input.txt`` holding ``text``."""
    path = root / "shakespeare" / "input.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    monkeypatch.setattr(ShakespeareCharDataModule, "sha256", sha256(path))
    return root


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file (the MNIST format): magic, dimensions, then uint8 data; gzip'd and raw."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.with_suffix("").write_bytes(raw)  # what torchvision reads
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(raw)


def write_mnist(
    root: Path, monkeypatch: pytest.MonkeyPatch, module: type, train: int = 40, test: int = 12
) -> None:
    """Random ``train`` and ``test`` images in ``<root>/<module.folder>/raw``."""
    raw = root / module.folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("t10k", test)):
        write_idx(raw / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,)))
    monkeypatch.setattr(module, "files", {p.name: sha256(p) for p in raw.glob("*.gz")})


def write_multi30k(root: Path, monkeypatch: pytest.MonkeyPatch, repeat: int = 3) -> None:
    """``PAIRS`` repeated, as the gzip'd train, val and test_2016_flickr files of Multi30k."""
    folder = root / "multi30k"
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val", "test_2016_flickr"):
        for lang, side in (("en", 0), ("de", 1)):
            path = folder / f"{split}.{lang}.gz"
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.writelines(pair[side] + "\n" for pair in PAIRS * repeat)
            monkeypatch.setitem(translation_module.MULTI30K_FILES, path.name, sha256(path))


def fake_data_root(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every downloadable data set, small, under ``root`` (with 5000 + 64 MNIST training
    images, enough for the configs' 5000 held-out validation images)."""
    write_text_root(root, monkeypatch, TEXT * 3)  # > 256-token windows in the 10% split
    for module in (MNISTDataModule, FashionMNISTDataModule):
        write_mnist(root, monkeypatch, module, train=5064, test=64)
    write_multi30k(root, monkeypatch, repeat=20)
    monkeypatch.setenv("TLAB_DATA_DIR", str(root))
    return root


def tiny_ranks() -> dict[bytes, int]:
    """Byte-level BPE ranks with a few merges."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b"th", b"e ", b"the", b"sp", b"ea", b"spea", b"speak"):
        ranks[merge] = len(ranks)
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> Path:
    """A .tiktoken ranks file: one base64 token and its rank per line."""
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


def write_hf_tokenizer(path: Path, texts: list[str]) -> Path:
    """A byte-level BPE of 300 ids trained on ``texts``, with <|endoftext|>, saved as a
    Hugging Face tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


HARNESS_TASKS = Path(__file__).resolve().parent / "harness_tasks"  # the tests' harness tasks


def write_task_corpus(folder: Path) -> Path:
    """A text file of the characters the tests' harness tasks use, so that a char
    tokenizer prepared on it reads them."""
    rows = [line for f in HARNESS_TASKS.glob("*.jsonl") for line in f.read_text().splitlines()]
    words = " ".join(json.dumps(json.loads(row)) for row in rows) + " xyz QZ"
    path = folder / "corpus.txt"
    path.write_text((words + "\n") * 20)
    return path
