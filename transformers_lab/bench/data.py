"""Is data loading ever the bottleneck? Batches per second of a data module against
training steps per second of the model it feeds.

Usage::

    python -m transformers_lab.bench.data            # baby GPT on Tiny Shakespeare

The loader is timed on its own (``--batches`` batches from a fresh iterator); the model is
timed on ``--steps`` AdamW steps (forward, backward, update) on batches already in memory.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from transformers_lab.data import ShakespeareCharDataModule
from transformers_lab.models import GPT


def loader_rate(loader, batches: int) -> float:
    """Batches per second drawn from ``loader``, over as many epochs as it takes."""
    next(iter(loader))  # start-up (imports, workers) is not the steady state
    drawn, start = 0, time.perf_counter()
    while drawn < batches:
        for _ in loader:
            drawn += 1
            if drawn == batches:
                break
    return batches / (time.perf_counter() - start)


def training_rate(model: GPT, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> float:
    """AdamW steps per second of ``model`` on one fixed batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch

    def step() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - start)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformers_lab.bench.data")
    parser.add_argument("--root", default=None, help="data root (default: TLAB_DATA_DIR)")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--num-workers", type=int, default=0)
    args = parser.parse_args(argv)

    dm = ShakespeareCharDataModule(
        root=args.root, block_size=64, batch_size=12, num_workers=args.num_workers
    )
    dm.setup()
    loader = dm.train_dataloader()
    data = loader_rate(loader, args.batches)
    model = GPT(n_layer=4, n_head=4, d_model=128, dropout=0.0, **dm.model_kwargs())
    train = training_rate(model, next(iter(loader)), args.steps)
    print(f"data module : {data:10.1f} batches/s (batch 12 x 64 tokens)")
    print(f"baby GPT    : {train:10.1f} training steps/s (4 layers, 128 wide, block 64)")
    print(f"ratio       : {data / train:10.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
