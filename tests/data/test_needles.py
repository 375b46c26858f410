"""The needle-in-a-haystack tasks: deterministic for a seed, the needle where it says,
only the answer supervised, and one clear line for what cannot fit."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import pytest
import torch

from transformers_lab.data.base import IGNORE
from transformers_lab.data.needles import (
    ALPHABET,
    FILLER,
    NeedleDataModule,
    draw_needle,
    encode,
    examples,
    needle_sentence,
    word_start,
)
from transformers_lab.errors import DataFileError

from fake_data import write_text_root

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40


def module(kind: str = "passkey", **kw) -> NeedleDataModule:
    options = {"block_size": 160, "train_examples": 6, "val_examples": 3} | kw
    dm = NeedleDataModule(kind, **options)
    dm.setup()
    return dm


@pytest.fixture
def text_root(tmp_path, monkeypatch):
    return write_text_root(tmp_path, monkeypatch, TEXT)  # shakespeare_char's checksum too


@pytest.mark.parametrize("kind", ["passkey", "text", "multikey"])
def test_each_task_is_the_same_for_a_seed_and_another_for_another(kind, text_root):
    options = {"root": str(text_root), "num_needles": 2 if kind == "multikey" else 1}
    a, b = module(kind, **options), module(kind, **options)
    other = module(kind, seed=1, **options)
    for split in ("train_set", "val_set"):
        assert all(
            torch.equal(x, y)
            for x, y in zip(getattr(a, split).tensors, getattr(b, split).tensors, strict=True)
        )
    assert not torch.equal(a.train_set.tensors[0], other.train_set.tensors[0])
    assert not torch.equal(a.train_set.tensors[0], a.val_set.tensors[0])  # disjoint seeds
    inputs, labels = a.train_set.tensors
    assert inputs.shape == labels.shape == (6, 160)
    assert a.model_kwargs() == {"vocab_size": len(ALPHABET), "block_size": 160}


@pytest.mark.parametrize("kind", ["passkey", "text", "multikey"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_needle_sits_at_its_depth_and_only_the_answer_is_supervised(kind, depth):
    text = FILLER if kind != "text" else TEXT
    count = 3 if kind == "multikey" else 1
    needle = draw_needle(kind, random.Random(7), 200, depth, count, 5, text)
    assert len(needle.context) + len(needle.answer) == 201
    haystack_end = needle.context.index("\nWhat is")
    assert needle.answer in needle.context[:haystack_end]
    order = sorted(range(count), key=lambda i: needle.starts[i])
    sentences = [needle.context[needle.starts[i] :].split(". ")[0] for i in order]
    assert all(s.startswith(("The pass key is ", "The magic number for ")) for s in sentences)
    lengths = [len(s) + len(". ") for s in sentences]
    if kind == "passkey":  # "... Remember it. N is the pass key. "
        lengths = [len(needle_sentence(kind, "", needle.answer))]
    # the haystack with the needles taken out, and where the first one was cut in
    first = needle.starts[order[0]]
    rest = needle.context[:first] + needle.context[first + sum(lengths) : haystack_end]
    assert len(rest) == needle.room
    # the same depth for every needle: they sit one after another, at the nearest word
    # start at or before depth * room
    assert [needle.starts[i] for i in order] == [first + sum(lengths[:k]) for k in range(count)]
    assert first == word_start(rest, round(depth * needle.room))
    assert first == 0 or rest[first - 1] in " \n"
    assert depth * needle.room - 20 <= first <= depth * needle.room
    # the example the module makes of it: the answer's digits after the question are the
    # only labels, each the next character
    (inputs, labels), ids = examples([needle])[:], encode(needle.context + needle.answer)
    assert inputs[0].tolist() == ids[:-1]
    supervised = (labels[0] != IGNORE).nonzero().flatten().tolist()
    assert supervised == list(range(200 - 5, 200))
    assert labels[0, supervised].tolist() == encode(needle.answer)


def test_the_module_s_labels_spell_the_answer(text_root):
    dm = module("text", root=str(text_root), depth=0.5)
    inputs, labels = dm.val_set.tensors
    for x, y in zip(inputs, labels, strict=True):
        kept = y[y != IGNORE].tolist()
        assert len(kept) == 5 and dm.detokenize(kept).isdigit()
        context = dm.detokenize(x.tolist())
        asked = context.rsplit("What is the magic number for ", 1)[1].split("?")[0]
        assert f"The magic number for {asked} is {dm.detokenize(kept)}." in context


def test_what_cannot_fit_is_one_clear_line(tmp_path):
    with pytest.raises(ValueError, match=r"^block_size=64 is too short for passkey: its needle, "):
        NeedleDataModule("passkey", block_size=64)
    with pytest.raises(
        ValueError, match=r"too short for multikey: its needles, .*or fewer needles"
    ):
        NeedleDataModule("multikey", block_size=160, num_needles=4)
    with pytest.raises(ValueError, match=r"^depth must be in \[0, 1\] .*got 1.5"):
        NeedleDataModule("passkey", depth=1.5)
    with pytest.raises(ValueError, match="multikey hides several needles"):
        NeedleDataModule("multikey", num_needles=1)
    with pytest.raises(ValueError, match="unknown needle task 'haystack'"):
        NeedleDataModule("haystack")
    with pytest.raises(DataFileError, match="shakespeare/input.txt"):
        module("text", root=str(tmp_path), download=False)


def test_the_filler_starts_at_any_of_its_words():
    rng = random.Random(0)
    starts = {draw_needle("passkey", rng, 160, 1.0).context[:12] for _ in range(60)}
    words = {FILLER[i:][:12] for i in range(len(FILLER)) if i == 0 or FILLER[i - 1] == " "}
    assert starts == {(w + FILLER)[:12] for w in words}  # every word, and only words


def test_no_validation_example_is_a_training_one():
    """At a fixed depth a passkey example is its number and the filler's first word: with
    2 digits (90 numbers) and 16 first words, 1000 training examples hold most of them."""
    dm = module("passkey", digits=2, depth=0.5, train_examples=1000, val_examples=200)
    train = {tuple(x.tolist()) for x in dm.train_set.tensors[0]}
    assert len(train) < 1000  # the training set repeats itself: the check has work to do
    assert not train & {tuple(x.tolist()) for x in dm.val_set.tensors[0]}
    with pytest.raises(ValueError, match="validation examples differ from the training set"):
        module("passkey", digits=1, depth=0.5, train_examples=1000, val_examples=200)


def test_multikey_data_is_the_same_under_any_hash_seed(tmp_path):
    """Keys are drawn in order: a set's order would follow PYTHONHASHSEED, and another
    process (a DDP rank, a resumed run) would get other data. This process's data against
    that of a process with another hash seed."""
    code = (
        "from transformers_lab.data.needles import NeedleDataModule as M;"
        "import hashlib;"
        "dm = M('multikey', block_size=200, num_needles=3, train_examples=8, val_examples=4);"
        "dm.setup();"
        "print(hashlib.sha256(dm.train_set.tensors[0].numpy().tobytes()).hexdigest())"
    )
    dm = NeedleDataModule("multikey", block_size=200, num_needles=3, train_examples=8,
                          val_examples=4)  # fmt: skip
    dm.setup()
    here = hashlib.sha256(dm.train_set.tensors[0].numpy().tobytes()).hexdigest()
    # this process's seed is random, or PYTHONHASHSEED's: the other process's is another
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here
