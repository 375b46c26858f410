"""Long Range Arena's generated tasks and the pixel sequences: deterministic for a seed,
labels right against independent checks (a stack evaluator of the expression, a flood fill
of the image), padding where it says, and a training step with every kernel an encoder
takes."""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transformers_lab.attention import KERNELS
from transformers_lab.data import (
    DigitsDataModule,
    ListOpsDataModule,
    MNISTDataModule,
    PathfinderDataModule,
)
from transformers_lab.data.listops import LISTOPS_VOCAB, listops
from transformers_lab.data.pathfinder import MARKER_LEVEL
from transformers_lab.models import EncoderClassifier

BOTH_WAYS = sorted(name for name, kernel in KERNELS.items() if not kernel.causal_only)
REAL = Path(os.environ.get("TLAB_DATA_DIR", "/nonexistent"))


def evaluate(tokens: list[str]) -> int:
    """A ListOps expression's value by a stack machine over its tokens, written apart from
    the generator's tree walk."""
    stack: list[list] = [[]]
    for token in tokens:
        if token.startswith("["):
            stack.append([token])
        elif token == "]":
            op, *args = stack.pop()
            args.sort()
            if op == "[MIN":
                value = min(args)
            elif op == "[MAX":
                value = max(args)
            elif op == "[SM":
                value = sum(args) % 10
            else:  # the median, the lower middle pair's mean rounded down
                n = len(args)
                value = args[n // 2] if n % 2 else (args[n // 2 - 1] + args[n // 2]) // 2
            stack[-1].append(value)
        else:
            stack[-1].append(int(token))
    (value,) = stack[0]
    return value


def listops_module(**kw) -> ListOpsDataModule:
    options = {
        "max_depth": 6,
        "max_args": 5,
        "min_length": 10,
        "max_length": 80,
        "train_examples": 60,
        "val_examples": 20,
        "test_examples": 20,
    } | kw
    dm = ListOpsDataModule(**options)
    dm.setup()
    return dm


def pathfinder_module(**kw) -> PathfinderDataModule:
    options = {
        "block_size": 400,
        "split": "easy",
        "distractors": 2,
        "train_examples": 40,
        "val_examples": 10,
        "test_examples": 10,
    } | kw
    dm = PathfinderDataModule(**options)
    dm.setup()
    return dm


def splits(dm) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [s.tensors for s in (dm.train_set, dm.val_set, dm.test_set)]


@pytest.mark.parametrize("make", [listops_module, pathfinder_module])
def test_each_task_is_the_same_for_a_seed_another_for_another_and_its_splits_disjoint(make):
    a, b, other = make(), make(), make(seed=1)
    for (xa, ya), (xb, yb) in zip(splits(a), splits(b), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.train_set.tensors[0], other.train_set.tensors[0])
    rows = [tuple(row.tolist()) for x, _ in splits(a) for row in x]
    assert len(set(rows)) == len(rows) == (100 if make is listops_module else 60)
    assert [len(y) for _, y in splits(a)] == (
        [60, 20, 20] if make is listops_module else [40, 10, 10]
    )


def test_listops_labels_are_the_values_of_their_expressions_and_lengths_in_bounds():
    dm = listops_module()
    pad = dm.pad_id
    lengths = []
    for inputs, labels in splits(dm):
        for row, label in zip(inputs.tolist(), labels.tolist(), strict=True):
            tokens = dm.detokenize(row).split()
            length = len(tokens)
            assert row[length:] == [pad] * (len(row) - length)  # padded at the end only
            assert pad not in row[:length]
            assert evaluate(tokens) == label
            lengths.append(length)
    assert min(lengths) > 10 and max(lengths) < 80
    assert dm.model_kwargs() == {
        "vocab_size": len(LISTOPS_VOCAB),
        "block_size": 79,
        "num_classes": 10,
        "pad_id": 0,
    }
    assert len(set(dm.train_set.tensors[1].tolist())) > 4  # not one class


def test_listops_says_so_when_too_few_trees_fit_rather_than_draw_forever():
    # 4 operators over 2 digits: 400 different trees, not 500
    with pytest.raises(ValueError, match="rarely fall between min_length=2 and max_length=8"):
        listops(500, seed=0, max_depth=2, max_args=2, min_length=2, max_length=8)


def test_listops_refuses_a_depth_past_what_it_can_recurse():
    with pytest.raises(ValueError, match="max_depth must be at most 100 .LRA uses 10., got 101"):
        ListOpsDataModule(max_depth=101)


def test_listops_draws_lras_distribution_whatever_its_length_budget():
    # the generator gives up on a tree once it is too long; the kept trees are the same
    # as those drawn whole and filtered (the same seed gives the same expressions)
    short, values = listops(30, seed=3, max_depth=5, max_args=4, min_length=5, max_length=40)
    assert all(5 < len(e) < 40 for e in short)
    assert [evaluate(e) for e in short] == values


def flood(image: list[list[int]], start: tuple[int, int], reach: int) -> set[tuple[int, int]]:
    """The drawn pixels reached from ``start`` through drawn pixels at most ``reach``
    apart (Chebyshev)."""
    size = len(image)
    seen, todo = {start}, deque([start])
    while todo:
        y, x = todo.popleft()
        for dy in range(-reach, reach + 1):
            for dx in range(-reach, reach + 1):
                p = (y + dy, x + dx)
                if 0 <= p[0] < size and 0 <= p[1] < size and image[p[0]][p[1]] and p not in seen:
                    seen.add(p)
                    todo.append(p)
    return seen


def markers(image: list[list[int]]) -> list[tuple[int, int]]:
    """One pixel of each marker: the brightest pixels, grouped by 8-connectivity."""
    bright = {(y, x) for y, row in enumerate(image) for x, v in enumerate(row) if v == MARKER_LEVEL}
    found = []
    while bright:
        first = bright.pop()
        found.append(first)
        group, todo = {first}, [first]
        while todo:
            y, x = todo.pop()
            for p in [(y + dy, x + dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]:
                if p in bright:
                    bright.discard(p)
                    group.add(p)
                    todo.append(p)
    return found


@pytest.mark.parametrize("split", ["easy", "hard"])
def test_pathfinder_labels_agree_with_a_flood_fill_from_one_marker(split):
    size = 32 if split == "hard" else 20
    dm = pathfinder_module(
        split=split, block_size=size**2, distractors=None if split == "hard" else 2
    )
    joined = 0
    for inputs, labels in splits(dm):
        for row, label in zip(inputs.tolist(), labels.tolist(), strict=True):
            image = [row[i : i + size] for i in range(0, size * size, size)]
            ends = markers(image)
            assert len(ends) == 2
            reached = flood(image, ends[0], reach=dm.gap + 1)
            assert (ends[1] in reached) == bool(label)
            joined += label
            # the task is not given away by the drawing: both labels draw as many paths
            assert sum(v > 0 for v in row) > 6 * 2
    assert joined == 30  # balanced
    assert dm.model_kwargs() == {"vocab_size": 256, "block_size": size * size, "num_classes": 2}


def test_digits_as_pixel_sequences_are_their_images_pixels():
    images, tokens = DigitsDataModule(), DigitsDataModule(as_sequence=True)
    images.setup(), tokens.setup()
    x, y = images.train_set[0]
    t, y2 = tokens.train_set[0]
    assert y == y2 and t.shape == (64,) and t.dtype == torch.long
    assert torch.equal(t, (x[0] * 255).round().long().flatten())
    assert tokens.model_kwargs() == {"vocab_size": 256, "block_size": 64, "num_classes": 10}


def test_pixel_side_averages_each_block_of_the_image_before_it_is_read():
    full = DigitsDataModule(as_sequence=True)
    small = DigitsDataModule(as_sequence=True, pixel_side=4)
    full.setup(), small.setup()
    t, _ = full.train_set[3]
    s, _ = small.train_set[3]
    assert s.shape == (16,) and small.model_kwargs()["block_size"] == 16
    # each token is its 2x2 block's mean intensity (to within the 8-bit rounding of both)
    blocks = t.view(4, 2, 4, 2).float().mean(dim=(1, 3)).flatten()
    assert (s.float() - blocks).abs().max() <= 1.0
    same = DigitsDataModule(as_sequence=True, pixel_side=8)  # the image's own side: unchanged
    same.setup()
    assert torch.equal(same.train_set[3][0], t)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"pixel_side": 4}, "needs as_sequence=true"),
        ({"as_sequence": True, "pixel_side": 9}, "between 1 and the image's side 8"),
        ({"as_sequence": True, "pixel_side": 0}, "pixel_side must be an integer >= 1"),
        ({"as_sequence": True, "pixel_side": 2.5}, "pixel_side must be an integer >= 1"),
        ({"as_sequence": True, "pixel_side": True}, "pixel_side must be an integer >= 1"),
    ],
)
def test_pixel_side_refuses_what_it_cannot_do(kwargs, words):
    with pytest.raises(ValueError, match=words):
        DigitsDataModule(**kwargs)


@pytest.mark.skipif(not (REAL / "MNIST" / "raw").is_dir(), reason="no MNIST in TLAB_DATA_DIR")
def test_mnist_as_pixel_sequences_are_784_raw_intensities():
    dm = MNISTDataModule(root=str(REAL), as_sequence=True, download=False)
    dm.prepare_data()
    dm.setup()
    tokens, label = dm.test_set[0]
    assert tokens.shape == (784,) and int(tokens.min()) >= 0 and int(tokens.max()) == 255
    assert label == 7  # the test set's first digit
    assert dm.model_kwargs()["block_size"] == 784
    half = MNISTDataModule(root=str(REAL), as_sequence=True, pixel_side=14, download=False)
    half.setup()
    small, _ = half.test_set[0]
    blocks = tokens.view(14, 2, 14, 2).float().mean(dim=(1, 3)).flatten()
    assert small.shape == (196,) and (small.float() - blocks).abs().max() <= 1.0


def tiny_batches():
    lo = listops_module(batch_size=4)
    pf = pathfinder_module(block_size=144, distractors=1, dashes=3, marker_distance=3, batch_size=4)
    digits = DigitsDataModule(as_sequence=True, batch_size=4)
    digits.setup()
    return {"listops": lo, "pathfinder": pf, "digits": digits}


BATCHES = {}


@pytest.mark.parametrize("task", ["listops", "pathfinder", "digits"])
@pytest.mark.parametrize("kernel", BOTH_WAYS)
def test_each_task_trains_a_step_with_every_kernel_an_encoder_takes(task, kernel):
    if not BATCHES:
        BATCHES.update(tiny_batches())
    dm = BATCHES[task]
    x, y = next(iter(dm.train_dataloader()))
    torch.manual_seed(0)
    sizes = dm.model_kwargs() | {"block_size": x.shape[1] + 8}  # room for more padding
    model = EncoderClassifier(d_model=16, n_layer=1, n_head=2, attention=kernel, **sizes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    if task == "listops":  # padding is honoured: more padding leaves the logits as they were
        model.eval()
        longer = F.pad(x, (0, 7), value=dm.pad_id)
        torch.testing.assert_close(model(longer), model(x), atol=1e-5, rtol=1e-4)


def test_the_examples_are_drawn_once_into_the_cache_and_read_back(tmp_path, monkeypatch):
    first = listops_module(cache_dir=str(tmp_path))
    (cache,) = tmp_path.glob("ListOpsDataModule-*.pt")

    def draw_again():
        raise AssertionError("drawn again despite the cache")

    monkeypatch.setattr(ListOpsDataModule, "generate", lambda self: draw_again())
    again = listops_module(cache_dir=str(tmp_path))
    for (xa, ya), (xb, yb) in zip(splits(first), splits(again), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    monkeypatch.undo()
    other = listops_module(cache_dir=str(tmp_path), seed=1)  # other options: another file
    assert len(list(tmp_path.glob("ListOpsDataModule-*.pt"))) == 2
    assert not torch.equal(other.train_set.tensors[0], first.train_set.tensors[0])
    cache.write_bytes(b"damaged")  # drawn again, and the file mended
    mended = listops_module(cache_dir=str(tmp_path))
    assert torch.equal(mended.train_set.tensors[0], first.train_set.tensors[0])
    assert torch.equal(torch.load(cache)[0], torch.cat([x for x, _ in splits(first)]))


@pytest.mark.parametrize(("make", "task"), [
    (listops_module, "ListOps"),
    (pathfinder_module, "Pathfinder"),
])  # fmt: skip
def test_drawing_shows_a_progress_bar_of_its_examples(make, task, monkeypatch):
    """At LRA's own sizes drawing takes minutes: a bar counts the examples drawn (tqdm's,
    shown on a terminal once 2 s have passed)."""
    import io

    import tqdm

    bars, real = [], tqdm.tqdm

    def on_a_terminal(**options):  # the bar as a terminal shows it
        bars.append((options, real(**options | {"disable": False, "file": io.StringIO()})))
        return bars[-1][1]

    monkeypatch.setattr(tqdm, "tqdm", on_a_terminal)
    make()
    ((options, bar),) = bars
    assert options["desc"] == f"drawing {task}" and options["delay"] == 2
    assert options["disable"] is None  # tqdm's: shown on a terminal only
    assert bar.total == (100 if task == "ListOps" else 60) and bar.n == bar.total
