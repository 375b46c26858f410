"""Needle-in-a-haystack tasks, generated from a seed and small enough for a CPU, read
character by character.

- ``passkey``: a number hidden in a repeated filler, asked for at the end (the passkey
  retrieval of Mohtashami & Jaggi, 2023; RULER's S-NIAH-1, Hsieh et al., 2024). The filler
  is their "The grass is green. The sky is blue. ..." and the needle "The pass key is
  N. Remember it. N is the pass key.".
- ``text``: a key-value sentence hidden in real text, Tiny Shakespeare from the data dir
  (S-NIAH-2; RULER's haystack is Paul Graham's essays). The needle is RULER's "One of the
  special magic numbers for K is: N." shortened to "The magic number for K is N.", the
  key K a random lowercase word.
- ``multikey``: ``num_needles`` such sentences with distinct keys in the filler, one asked
  for (S-NIAH-3 / MK-NIAH).

Each example is ``block_size + 1`` characters: the haystack with the needle(s) at
``depth`` (0: its start, 1: its end; null draws one per example, as a training set
should), then the question, whose answer (the number) is the only thing supervised: the
labels are ``IGNORE`` elsewhere. A needle starts at a word boundary, the nearest at or
before its depth. The training and validation sets use disjoint seeds (and, for text,
disjoint parts of the text: the first nine tenths and the last tenth), and no validation
example is one of the training set.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from transformers_lab.data.base import IGNORE, InMemoryDataModule
from transformers_lab.data.download import data_root, ensure_file
from transformers_lab.data.text import ShakespeareCharDataModule
from transformers_lab.errors import at_least

KINDS = ("passkey", "text", "multikey")
# every character an example may hold: newline and printable ASCII (Tiny Shakespeare is
# ASCII)
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@dataclass(frozen=True)
class Needle:
    """One example as text: the ``context`` (haystack, needles, question) and the
    ``answer`` that follows it; where each needle starts in ``context``."""

    context: str
    answer: str
    starts: tuple[int, ...]
    room: int  # the haystack's length, the needles aside


def needle_sentence(kind: str, key: str, value: str) -> str:
    if kind == "passkey":
        return f"The pass key is {value}. Remember it. {value} is the pass key. "
    return f"The magic number for {key} is {value}. "


def question(kind: str, key: str) -> str:
    """The question after the haystack, on a line of its own; the answer follows it."""
    if kind == "passkey":
        return "\nWhat is the pass key? The pass key is "
    return f"\nWhat is the magic number for {key}? The magic number for {key} is "


def draw_needle(
    kind: str,
    rng: random.Random,
    block_size: int,
    depth: float | None,
    num_needles: int = 1,
    digits: int = 5,
    text: str = FILLER,
) -> Needle:
    """One example of ``kind``: a haystack from ``text`` (from a random place; the filler
    repeated), the needles at ``depth`` (each its own depth when None), the question, and
    the answer: ``block_size + 1`` characters in all."""
    count = num_needles if kind == "multikey" else 1
    keys = draw_keys(rng, count) if kind != "passkey" else [""]
    values = [str(rng.randrange(10 ** (digits - 1), 10**digits)) for _ in keys]
    asked = rng.randrange(len(keys))
    needles = [needle_sentence(kind, k, v) for k, v in zip(keys, values, strict=True)]
    tail = question(kind, keys[asked])
    room = block_size + 1 - len(tail) - digits - sum(map(len, needles))
    if room < 1:
        raise ValueError(needle_refusal(kind, block_size, digits, count))
    # a random word start: in the filler any of its words (the haystack repeats it from
    # there); in a text, one the haystack fits after where it can
    cyclic = kind != "text" or len(text) <= room
    start = rng.randrange(len(text) if cyclic else len(text) - room)
    start = next((i + 1 for i in range(start - 1, len(text) - 1) if text[i] in " \n"), 0)
    haystack = (text[start:] + text * (room // len(text) + 1))[:room]
    depths = [rng.random() if depth is None else depth for _ in needles]
    cuts = sorted(
        (word_start(haystack, round(d * room)), i) for i, d in enumerate(depths)
    )  # where each needle goes in the haystack, in order
    pieces, starts, done, shift = [], [0] * len(needles), 0, 0
    for cut, i in cuts:
        pieces.append(haystack[done:cut])
        starts[i] = cut + shift
        pieces.append(needles[i])
        shift += len(needles[i])
        done = cut
    pieces.append(haystack[done:])
    return Needle("".join(pieces) + tail, values[asked], tuple(starts), room)


def word_start(text: str, at: int) -> int:
    """The start of the word at or before ``at`` (0, or just after a space or newline)."""
    at = min(max(at, 0), len(text))
    while at > 0 and text[at - 1] not in " \n":
        at -= 1
    return at


def draw_keys(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct random lowercase words of 4 to 7 letters."""
    keys: list[str] = []  # in draw order: a set's order would follow PYTHONHASHSEED
    while len(keys) < count:
        key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 7)))
        if key not in keys:
            keys.append(key)
    rng.shuffle(keys)
    return keys


LONGEST_KEY = "x" * 7  # draw_keys' longest


def needed_chars(kind: str, digits: int, count: int) -> int:
    """The characters the needles, the question and the answer take at most."""
    key = "" if kind == "passkey" else LONGEST_KEY
    needle = len(needle_sentence(kind, key, "0" * digits))
    return len(question(kind, key)) + digits + count * needle


def needle_refusal(kind: str, block_size: int, digits: int, count: int) -> str:
    """The refusal of a context too short for its needles and question."""
    needed = needed_chars(kind, digits, count)
    return (
        f"block_size={block_size} is too short for {kind}: its needle"
        f"{'s' if count > 1 else ''}, question and answer take up to {needed} characters; "
        f"give block_size >= {needed} (a haystack around them), or fewer needles or digits"
    )


def encode(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def examples(needles: Sequence[Needle]) -> TensorDataset:
    """Inputs and labels (n, block_size): next-character prediction, supervised on the
    answer only."""
    inputs, labels = [], []
    for needle in needles:
        ids = encode(needle.context + needle.answer)
        label = [IGNORE] * (len(needle.context) - 1) + ids[len(needle.context) :]
        inputs.append(ids[:-1])
        labels.append(label)
    return TensorDataset(torch.tensor(inputs), torch.tensor(labels))


class NeedleDataModule(InMemoryDataModule):
    """Needle in a haystack: ``passkey``, ``text`` or ``multikey`` (see the module).

    Args:
        kind: passkey, text or multikey.
        block_size: characters per example (the model's context).
        depth: where the needles sit in the haystack, in [0, 1]; null: a random depth for
            each needle of each example.
        num_needles: multikey's needles (at least 2); passkey and text hide one.
        digits: the number's digits (RULER's values have 7).
        root: the data dir holding ``shakespeare/input.txt`` (text); null: the default.
        download: fetch Tiny Shakespeare if it is not there (text).
        train_examples, val_examples, batch_size, num_workers: the sets and loaders.
        seed: the training set uses ``seed``, validation ``seed + 1``.
    """

    def __init__(
        self,
        kind: str = "passkey",
        block_size: int = 256,
        depth: float | None = None,
        num_needles: int = 1,
        digits: int = 5,
        root: str | None = None,
        download: bool = True,
        train_examples: int = 4000,
        val_examples: int = 256,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown needle task {kind!r}; valid ones are: {', '.join(KINDS)}")
        at_least(1, block_size=block_size, digits=digits, batch_size=batch_size)
        at_least(1, train_examples=train_examples, val_examples=val_examples)
        at_least(0, num_workers=num_workers)
        if depth is not None and not (isinstance(depth, int | float) and 0 <= depth <= 1):
            raise ValueError(
                f"depth must be in [0, 1] (0: the haystack's start, 1: its end) or null "
                f"(a random depth per needle), got {depth!r}"
            )
        if kind == "multikey" and num_needles < 2:
            raise ValueError(
                f"multikey hides several needles: num_needles must be >= 2, got {num_needles}"
            )
        if kind != "multikey" and num_needles != 1:
            raise ValueError(
                f"{kind} hides one needle: num_needles must be 1 (multikey hides more)"
            )
        count = num_needles if kind == "multikey" else 1
        if block_size + 1 - needed_chars(kind, digits, count) < 1:
            raise ValueError(needle_refusal(kind, block_size, digits, count))
        self.kind, self.block_size, self.depth = kind, block_size, depth
        self.num_needles, self.digits = count, digits
        self.root, self.download = data_root(root), download
        self.train_examples, self.val_examples = train_examples, val_examples
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    @property
    def text_file(self) -> Path:
        return self.root / "shakespeare" / "input.txt"

    def prepare_data(self) -> None:
        """Tiny Shakespeare for the text haystack, fetched and checksummed as
        ``shakespeare_char`` fetches it (``download=false``: only where it is)."""
        if self.kind == "text":
            source = ShakespeareCharDataModule  # its file, its checksum
            ensure_file(self.text_file, source.url, source.sha256, download=self.download)

    def haystacks(self) -> tuple[str, str]:
        """The text the training and the validation haystacks are cut from."""
        if self.kind != "text":
            return FILLER, FILLER
        self.prepare_data()
        text = "".join(c for c in self.text_file.read_text() if c in ALPHABET)
        cut = len(text) * 9 // 10
        return text[:cut], text[cut:]

    def generate(
        self, num_examples: int, seed: int, text: str, unlike: Sequence[Needle] = ()
    ) -> list[Needle]:
        """``num_examples`` needles drawn from ``seed``, none the same as one of
        ``unlike`` (the training set: a validation example it holds would be recall of
        the training set, not of the context)."""
        rng, seen = random.Random(seed), {n.context + n.answer for n in unlike}
        drawn: list[Needle] = []
        for _ in range(20 * num_examples + 100):
            if len(drawn) == num_examples:
                return drawn
            needle = draw_needle(
                self.kind, rng, self.block_size, self.depth, self.num_needles, self.digits, text
            )
            if needle.context + needle.answer not in seen:
                drawn.append(needle)
        raise ValueError(
            f"{self.kind} at block_size={self.block_size}, depth={self.depth}: fewer than "
            f"{num_examples} validation examples differ from the training set; give more "
            "digits or fewer examples"
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            train_text, val_text = self.haystacks()
            train = self.generate(self.train_examples, self.seed, train_text)
            val = self.generate(self.val_examples, self.seed + 1, val_text, unlike=train)
            self.train_set, self.val_set = examples(train), examples(val)

    def model_keys(self) -> set[str]:
        return {"vocab_size", "block_size"}

    def model_kwargs(self) -> dict[str, int]:
        return {"vocab_size": len(ALPHABET), "block_size": self.block_size}

    def detokenize(self, ids: Sequence[int]) -> str:
        return "".join(ALPHABET[i] for i in ids)
