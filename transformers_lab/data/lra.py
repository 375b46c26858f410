"""Long Range Arena's generated tasks (Tay et al., 2021): ListOps and Pathfinder, built from
a seed on the CPU, with LRA's rules and sizes as the defaults.

- **ListOps** (Nangia and Bowman, 2018, as LRA generates it in
  ``lra_benchmarks/data/listops.py``): nested ``[MAX``, ``[MIN``, ``[MED`` and ``[SM``
  (sum modulo 10) over the digits 0-9, closed by ``]``; the label is the expression's value,
  10 classes. A node below ``max_depth`` is an operator with probability 0.25, over 2 to
  ``max_args`` arguments, else a digit; trees are drawn until ``min_length < tokens <
  max_length`` (LRA: depth 10, 10 arguments, 500 to 2000 tokens, 96000/2000/2000 unique
  examples). LRA's input pipeline drops the tree's brackets ``(`` ``)``; the tokens are the
  operators, digits and ``]``, padded to ``max_length``.
- **Pathfinder** (Linsley et al., 2018; Kim et al., 2020): a 32x32 image holds two long
  dashed paths and short distractors; two markers lie either on the two ends of one path
  (label 1) or on one end of each long path (label 0). LRA reads the image as 1,024 8-bit
  pixel tokens. Its data came from Linsley's generator with, at 32x32 (LRA's
  ``lra_benchmarks/data/pathfinder.py``): paddles of 2 pixels with a margin of 1, markers
  of radius 1.5, markers at least 7 pixels apart, distractors a third of the path's length,
  20 // that many of them, and splits easy, intermediate and hard of paths 6, 9 and 14
  paddles long. This generator is our own on those rules: a path is a walk of dashes
  (``dash`` pixels drawn, ``gap`` left blank, turning by at most ``max_turn`` radians
  between dashes) and different paths keep more than ``gap + 1`` pixels apart, so that
  "joined" is exactly "one component when pixels up to ``gap + 1`` apart (Chebyshev)
  touch": a flood fill over the pixels gives the label back.
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
from transformers_lab.errors import at_least, must_be
from transformers_lab.files import atomic_write

# ---------------------------------------------------------------------------- ListOps

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
PAD = "<pad>"
LISTOPS_VOCAB = (PAD, *map(str, range(10)), *OPERATORS, END)  # id 0 pads
LISTOPS_IDS = {token: i for i, token in enumerate(LISTOPS_VOCAB)}
OPERATOR_P = 0.25  # LRA's VALUE_P: below max_depth a node is an operator with this chance
# the generator and the evaluator recurse once a level: well inside Python's 1000 frames
LISTOPS_MAX_DEPTH = 100

Tree = int | tuple[str, list["Tree"]]


class TooLong(Exception):
    """A tree grew past the longest kept: drawing it further would be thrown away."""


def listops_tree(
    rng: random.Random, depth: int, max_depth: int, max_args: int, budget: list[int] | None = None
) -> Tree:
    """A random ListOps tree drawn as LRA's ``generate_tree``: below ``max_depth`` a node is
    an operator with probability 0.25, over 2 to ``max_args`` arguments, else a digit.

    ``budget`` ([tokens left]) stops a tree that grows past it (``TooLong``): a tree LRA
    would reject for its length is rejected before it is drawn whole, which leaves the
    distribution of the kept ones as it was."""
    if budget is not None:
        budget[0] -= 1
        if budget[0] < 0:
            raise TooLong
    if depth < max_depth and rng.random() <= OPERATOR_P:
        if budget is not None:
            budget[0] -= 1  # the closing bracket
        count = rng.randint(2, max_args)
        args = [listops_tree(rng, depth + 1, max_depth, max_args, budget) for _ in range(count)]
        return (rng.choice(OPERATORS), args)
    return rng.randrange(10)


def listops_value(tree: Tree) -> int:
    """The value of a ListOps tree: MED is the median rounded down (numpy's median of an
    even count, then ``int``, as LRA labels it), SM the sum modulo 10."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    values = sorted(listops_value(arg) for arg in args)
    if op == "[MIN":
        return values[0]
    if op == "[MAX":
        return values[-1]
    if op == "[SM":
        return sum(values) % 10
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else int((values[mid - 1] + values[mid]) / 2)


def listops_tokens(tree: Tree) -> list[str]:
    """The tree written as LRA's model reads it: operators, digits and ``]``."""
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    return [op, *(token for arg in args for token in listops_tokens(arg)), END]


def check_listops(max_depth: int, max_args: int, min_length: int, max_length: int) -> None:
    """Refuse ListOps sizes no tree can meet."""
    at_least(1, max_depth=max_depth)
    at_least(2, max_args=max_args)
    at_least(0, min_length=min_length)
    if max_depth > LISTOPS_MAX_DEPTH:
        raise ValueError(
            must_be("max_depth", f"at most {LISTOPS_MAX_DEPTH} (LRA uses 10)", max_depth)
        )
    # the longest tree: every node above the last level an operator of max_args arguments
    operators = sum(max_args**level for level in range(max_depth - 1))
    longest = 2 * operators + max_args ** (max_depth - 1)
    if max_length <= min_length + 1:
        raise ValueError(
            f"max_length={max_length} must exceed min_length={min_length} + 1: the lengths "
            "kept lie strictly between them (LRA: 500 and 2000)"
        )
    if min_length + 1 > longest:
        raise ValueError(
            f"min_length={min_length} is out of reach: trees of max_depth={max_depth} and "
            f"max_args={max_args} are at most {longest} tokens long; lower min_length or "
            "raise max_depth or max_args"
        )


def listops(
    num_examples: int,
    seed: int,
    max_depth: int = 10,
    max_args: int = 10,
    min_length: int = 500,
    max_length: int = 2000,
) -> tuple[list[list[str]], list[int]]:
    """``num_examples`` distinct ListOps expressions (token lists) and their values, drawn
    from ``seed`` as LRA draws them: a tree is kept when ``min_length < tokens <
    max_length`` and it is new."""
    check_listops(max_depth, max_args, min_length, max_length)
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()
    expressions: list[list[str]] = []
    values: list[int] = []
    misses = 0  # draws since the last one kept: LRA's sizes keep about 1 in 12
    while len(expressions) < num_examples:
        misses += 1
        if misses > 100_000:
            raise ValueError(
                f"ListOps trees of max_depth={max_depth} and max_args={max_args} rarely fall "
                f"between min_length={min_length} and max_length={max_length} tokens, or too "
                f"few differ for {num_examples} examples; widen the lengths or raise the depth"
            )
        try:
            tree = listops_tree(rng, 1, max_depth, max_args, budget=[max_length - 1])
        except TooLong:
            continue
        tokens = listops_tokens(tree)
        key = tuple(tokens)
        if min_length < len(tokens) < max_length and key not in seen:
            seen.add(key)
            expressions.append(tokens)
            values.append(listops_value(tree))
            misses = 0
    return expressions, values


def padded_ids(rows: Sequence[Sequence[int]], length: int) -> Tensor:
    """(len(rows), length) ids, each row padded with 0 at its end."""
    out = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


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
        expressions, values = listops(
            total, self.seed, self.max_depth, self.max_args, self.min_length, self.max_length
        )
        rows = [[LISTOPS_IDS[token] for token in tokens] for tokens in expressions]
        return padded_ids(rows, self.block_size), torch.tensor(values, dtype=torch.long)

    def tokenize(self, text: str) -> list[int]:
        return [LISTOPS_IDS[token] for token in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(LISTOPS_VOCAB[i] for i in ids if i != self.pad_id)


# ------------------------------------------------------------------------- Pathfinder

PATHFINDER_SPLITS = {"easy": 6, "intermediate": 9, "hard": 14}  # dashes of a path
PATH_LEVEL, MARKER_LEVEL = 191, 255  # 8-bit intensities: LRA's paddle contrast 0.75, markers 1
Pixel = tuple[int, int]


def near(pixels: set[Pixel], radius: int) -> set[Pixel]:
    """The pixels within Chebyshev distance ``radius`` of ``pixels``."""
    span = range(-radius, radius + 1)
    return {(y + dy, x + dx) for y, x in pixels for dy in span for dx in span}


class PathCanvas:
    """One Pathfinder image while it is drawn: each path's pixels, kept more than
    ``reach = gap + 1`` pixels (Chebyshev) from every other path's."""

    def __init__(self, size: int, dash: int, gap: int, max_turn: float, rng: random.Random):
        self.size, self.dash, self.gap, self.max_turn, self.rng = size, dash, gap, max_turn, rng
        self.reach = gap + 1
        self.paths: list[set[Pixel]] = []
        self.blocked: set[Pixel] = set()  # within reach of a path drawn already

    def inside(self, pixel: Pixel, margin: int = 1) -> bool:
        return all(margin <= c < self.size - margin for c in pixel)

    def walk(
        self, dashes: int, marked: bool = False, tries: int = 50
    ) -> tuple[set[Pixel], Pixel, Pixel] | None:
        """A path of ``dashes`` dashes clear of the others: (pixels, first end, last end),
        or None when ``tries`` random starts all ran into a border or another path.
        ``marked``: its ends need room for markers (3x3 squares) clear of the others too."""
        for _ in range(tries):
            y, x = (self.rng.uniform(2, self.size - 3) for _ in range(2))
            angle = self.rng.uniform(0, 2 * math.pi)
            drawn: list[Pixel] = []
            ok = True
            for d in range(dashes):
                dash = self.next_dash(y, x, angle, first=not d)
                if dash is None:
                    ok = False
                    break
                y, x, angle, pixels = dash
                drawn += pixels
            if ok and marked:  # room for a marker on either end, clear of the others
                room = near({drawn[0], drawn[-1]}, 1)
                ok = all(self.inside(p, 0) for p in room) and not room & self.blocked
            if ok:
                return set(drawn), drawn[0], drawn[-1]
        return None

    def next_dash(
        self, y: float, x: float, angle: float, first: bool, turns: int = 8
    ) -> tuple[float, float, float, list[Pixel]] | None:
        """The next dash from (y, x): a turn of at most ``max_turn`` (none for the first),
        ``gap`` blank steps then ``dash`` drawn ones, inside the border and clear of the
        other paths; up to ``turns`` turns are tried. Returns where it ends, its angle
        and its pixels, or None."""
        for _ in range(1 if first else turns):
            turned = angle if first else angle + self.rng.uniform(-self.max_turn, self.max_turn)
            dy, dx = math.sin(turned), math.cos(turned)
            steps = range(self.dash) if first else range(self.gap + 1, self.gap + 1 + self.dash)
            pixels = [(round(y + s * dy), round(x + s * dx)) for s in steps]
            if all(self.inside(p) and p not in self.blocked for p in pixels):
                last = steps[-1]
                return y + last * dy, x + last * dx, turned, pixels
        return None

    def add(self, pixels: set[Pixel], room: set[Pixel] = frozenset()) -> None:
        """Draw a path; ``room`` (its markers' squares) is kept clear of later paths too."""
        self.paths.append(pixels)
        self.blocked |= near(pixels | room, self.reach)


def pathfinder_image(
    rng: random.Random,
    label: int,
    size: int = 32,
    dashes: int = 14,
    distractors: int | None = None,
    distractor_dashes: int | None = None,
    dash: int = 2,
    gap: int = 1,
    max_turn: float = math.pi / 4,
    marker_distance: int = 7,
) -> tuple[list[list[int]], list[Pixel]] | None:
    """One image (``size`` rows of 8-bit pixels) and its two markers' centres, or None when
    the paths did not fit (the caller draws again).

    Two paths of ``dashes`` dashes, then ``distractors`` (LRA: 20 // their length) paths of
    ``distractor_dashes`` (LRA: a third of ``dashes``). Markers (3x3 squares) sit on the ends
    of the first path (``label`` 1) or on an end of each (``label`` 0), at least
    ``marker_distance`` pixels apart (Euclidean) either way."""
    distractor_dashes = distractor_dashes or max(1, dashes // 3)
    distractors = 20 // distractor_dashes if distractors is None else distractors
    canvas = PathCanvas(size, dash, gap, max_turn, rng)
    ends = []
    for _ in range(2):
        found = canvas.walk(dashes, marked=True)
        if found is None:
            return None
        pixels, first, last = found
        ends.append((first, last))
        canvas.add(pixels, room=near({first, last}, 1))
    markers = list(ends[0]) if label else [ends[0][rng.randrange(2)], ends[1][rng.randrange(2)]]
    if math.dist(*markers) < marker_distance:
        return None
    for _ in range(distractors):
        found = canvas.walk(distractor_dashes)
        if found is not None:
            canvas.add(found[0])
    image = [[0] * size for _ in range(size)]
    for pixels in canvas.paths:
        for y, x in pixels:
            image[y][x] = PATH_LEVEL
    for y, x in near(set(markers), 1):
        image[y][x] = MARKER_LEVEL
    return image, markers


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
        while len(images) < total:
            label = len(images) % 2  # balanced; the loaders shuffle the training split
            drawn = pathfinder_image(
                rng,
                label,
                self.size,
                self.dashes,
                self.distractors,
                None,
                self.dash,
                self.gap,
                self.max_turn,
                self.marker_distance,
            )
            if drawn is None:
                failures += 1
                if failures > 100 * (len(images) + 10):
                    raise ValueError(
                        f"Pathfinder paths of {self.dashes} dashes rarely fit a {self.size}x"
                        f"{self.size} image; use fewer dashes or distractors, or a larger size"
                    )
                continue
            key = tuple(v for row in drawn[0] for v in row)
            if key not in seen:
                seen.add(key)
                images.append(key)
                labels.append(label)
        return torch.tensor(images, dtype=torch.long), torch.tensor(labels, dtype=torch.long)
