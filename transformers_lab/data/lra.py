"""Long Range Arena's generated tasks (Tay et al., 2021) as data modules: ListOps and
Pathfinder, drawn from a seed on the CPU with LRA's rules and sizes as the defaults, split
into training, validation and test with no example in two splits, and cached once drawn.

The examples come from the tasks' generators: ``listops`` (expressions and their values)
and ``pathfinder`` (images of dashed paths and whether the markers are joined).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import pickle
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from transformers_lab.data.base import InMemoryDataModule
from transformers_lab.data.listops import LISTOPS_IDS, LISTOPS_VOCAB, check_listops, listops
from transformers_lab.data.pathfinder import PATHFINDER_SPLITS, pathfinder_image
from transformers_lab.errors import at_least
from transformers_lab.files import atomic_write


def padded_ids(rows: Sequence[Sequence[int]], length: int) -> Tensor:
    """(len(rows), length) ids, each row padded with 0 at its end."""
    out = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def drawing(total: int, task: str) -> Any:
    """A progress bar of the examples drawn, shown once drawing has taken 2 s (LRA's full
    ListOps takes minutes on 2 cores) and only on a terminal; a context manager."""
    from tqdm import tqdm

    return tqdm(total=total, desc=f"drawing {task}", unit="example", delay=2, disable=None)


class LRADataModule(InMemoryDataModule):
    """What the two generated LRA tasks share: training, validation and test splits drawn
    from one seed with no example in two of them, a test loader, and the sizes an
    encoder classifier takes from them.

    ``cache_dir``: where the examples are kept once drawn (a file named by the options that
    drew them, written atomically), so that the jobs of a sweep draw them once; None draws
    them in every run. A cache that cannot be written is skipped."""

    vocab_size: int
    num_classes: int
    block_size: int
    pad_id: int | None = None
    drawing = 1  # part of the cache's name: raise it when a change draws other examples

    def __init__(
        self,
        train_examples: int,
        val_examples: int,
        test_examples: int,
        batch_size: int,
        seed: int,
        num_workers: int,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        at_least(1, train_examples=train_examples, val_examples=val_examples, batch_size=batch_size)
        at_least(0, test_examples=test_examples, num_workers=num_workers)
        self.train_examples, self.val_examples = train_examples, val_examples
        self.test_examples = test_examples
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None
        self.cache_dir = cache_dir

    def generate(self) -> tuple[Tensor, Tensor]:
        """All examples, training first, then validation, then test: (inputs, labels)."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """What the examples depend on: the file name of their cache."""
        keep = ("batch_size", "num_workers", "cache_dir", "train_set", "val_set", "test_set")
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k not in keep}

    def cached(self) -> tuple[Tensor, Tensor]:
        """``generate()``, read from ``cache_dir`` where an earlier run left it."""
        if self.cache_dir is None:
            return self.generate()
        options = json.dumps([self.drawing, self.options()], sort_keys=True, default=str)
        digest = hashlib.sha256(options.encode()).hexdigest()[:16]
        path = Path(self.cache_dir) / f"{type(self).__name__}-{digest}.pt"
        if path.is_file():
            try:
                inputs, labels = torch.load(path, weights_only=True)
                return inputs, labels
            except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
                pass  # a damaged cache is drawn again
        inputs, labels = self.generate()
        with contextlib.suppress(OSError):  # a folder we cannot write: no cache, run on
            atomic_write(path, lambda f: torch.save((inputs, labels), f))
        return inputs, labels

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        inputs, labels = self.cached()
        cuts = [0, self.train_examples, self.train_examples + self.val_examples, len(labels)]
        self.train_set, self.val_set, self.test_set = (
            TensorDataset(inputs[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)
        )

    def test_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(self.test_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def model_keys(self) -> set[str]:
        return {"vocab_size", "block_size", "num_classes"} | (
            {"pad_id"} if self.pad_id is not None else set()
        )

    def model_kwargs(self) -> dict[str, Any]:
        sizes = {
            "vocab_size": self.vocab_size,
            "block_size": self.block_size,
            "num_classes": self.num_classes,
        }
        return sizes | ({"pad_id": self.pad_id} if self.pad_id is not None else {})


class ListOpsDataModule(LRADataModule):
    """LRA's ListOps: expressions of ``min_length`` to ``max_length`` tokens (exclusive)
    padded with id 0 to ``max_length``, labelled with their value (10 classes). The
    defaults are LRA's; ``tokenize`` and ``detokenize`` show an example as text."""

    vocab_size, num_classes, pad_id = len(LISTOPS_VOCAB), 10, 0

    def __init__(
        self,
        max_depth: int = 10,
        max_args: int = 10,
        min_length: int = 500,
        max_length: int = 2000,
        train_examples: int = 96000,
        val_examples: int = 2000,
        test_examples: int = 2000,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__(
            train_examples, val_examples, test_examples, batch_size, seed, num_workers, cache_dir
        )
        check_listops(max_depth, max_args, min_length, max_length)
        self.max_depth, self.max_args = max_depth, max_args
        self.min_length, self.max_length = min_length, max_length
        self.block_size = max_length - 1  # the longest kept expression

    def generate(self) -> tuple[Tensor, Tensor]:
        total = self.train_examples + self.val_examples + self.test_examples
        with drawing(total, "ListOps") as bar:
            expressions, values = listops(
                total, self.seed, self.max_depth, self.max_args, self.min_length,
                self.max_length, bar.update,
            )  # fmt: skip
        rows = [[LISTOPS_IDS[token] for token in tokens] for tokens in expressions]
        return padded_ids(rows, self.block_size), torch.tensor(values, dtype=torch.long)

    def tokenize(self, text: str) -> list[int]:
        return [LISTOPS_IDS[token] for token in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(LISTOPS_VOCAB[i] for i in ids if i != self.pad_id)


class PathfinderDataModule(LRADataModule):
    """Pathfinder read as ``block_size`` 8-bit pixel tokens row by row (LRA's reading): a
    square image (LRA: 1024 = 32x32), labels balanced between joined (1) and not (0).

    ``split`` names LRA's difficulty (easy, intermediate, hard: paths of 6, 9, 14 dashes);
    ``dashes`` overrides it."""

    vocab_size, num_classes = 256, 2

    def __init__(
        self,
        block_size: int = 1024,
        split: str = "hard",
        dashes: int | None = None,
        distractors: int | None = None,
        dash: int = 2,
        gap: int = 1,
        max_turn: float = math.pi / 4,
        marker_distance: int = 7,
        train_examples: int = 160000,
        val_examples: int = 20000,
        test_examples: int = 20000,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__(
            train_examples, val_examples, test_examples, batch_size, seed, num_workers, cache_dir
        )
        if split not in PATHFINDER_SPLITS:
            raise ValueError(
                f"unknown split {split!r}; valid ones are: {', '.join(PATHFINDER_SPLITS)}"
            )
        at_least(64, block_size=block_size)
        size = math.isqrt(block_size)
        if size * size != block_size:
            raise ValueError(
                f"block_size={block_size} is not a square: Pathfinder reads a square image row "
                f"by row; give a square's pixels, e.g. {size * size} ({size}x{size}) or "
                f"{(size + 1) ** 2} ({size + 1}x{size + 1}); LRA's is 1024 (32x32)"
            )
        dashes = PATHFINDER_SPLITS[split] if dashes is None else dashes
        at_least(1, dashes=dashes, dash=dash)
        at_least(0, gap=gap)
        self.size, self.dashes, self.distractors = size, dashes, distractors
        self.dash, self.gap, self.max_turn = dash, gap, max_turn
        self.marker_distance = marker_distance
        self.block_size = block_size

    def generate(self) -> tuple[Tensor, Tensor]:
        total = self.train_examples + self.val_examples + self.test_examples
        rng = random.Random(self.seed)
        images, labels, seen, failures = [], [], set(), 0
        with drawing(total, "Pathfinder") as bar:
            while len(images) < total:
                label = len(images) % 2  # balanced; the loaders shuffle the training split
                drawn = pathfinder_image(
                    rng, label, self.size, self.dashes, self.distractors, None, self.dash,
                    self.gap, self.max_turn, self.marker_distance,
                )  # fmt: skip
                if drawn is None:
                    failures += 1
                    if failures > 100 * (len(images) + 10):
                        raise ValueError(
                            f"Pathfinder paths of {self.dashes} dashes rarely fit a "
                            f"{self.size}x{self.size} image; use fewer dashes or "
                            "distractors, or a larger size"
                        )
                    continue
                key = tuple(v for row in drawn[0] for v in row)
                if key not in seen:
                    seen.add(key)
                    images.append(key)
                    labels.append(label)
                    bar.update()
        return torch.tensor(images, dtype=torch.long), torch.tensor(labels, dtype=torch.long)
