"""The streaming backend (``data.backend=litdata``): a prepared corpus's tokens in Lightning
``litdata``'s chunks, read through its ``StreamingDataset`` from a local folder or object
storage (``s3://``, ``gs://``), for corpora past one machine's disk.

The chunks are written once from the shards (``optimize``), split by split; a folder that
already holds them (a local one, or a bucket they were copied to) is read as it is. A
training item is a window of block_size + 1 tokens, the windows laid end to end (litdata's
``TokensLoader``); litdata shuffles them by its seed and splits them between ranks and
workers. The loader's state goes into every checkpoint and a resumed run takes it up.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from transformers_lab.data.corpus.prepare import locked
from transformers_lab.data.corpus.windows import TokenStream
from transformers_lab.errors import ConfigError

log = logging.getLogger(__name__)

PIECE = 1 << 20  # tokens a written item holds; TokensLoader reads across them


def _pieces(item: tuple[str, int, int, str]) -> Iterator[Tensor]:
    path, start, end, dtype = item
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    bits = np.int16 if dtype == "uint16" else np.int32  # litdata keeps torch's types
    for a in range(start, end, PIECE):
        yield torch.from_numpy(np.array(tokens[a : min(end, a + PIECE)]).view(bits))


def is_remote(folder: str) -> bool:
    return "://" in folder


def write_chunks(stream: TokenStream, out: str, chunk_bytes: str = "64MB") -> None:
    """The tokens of ``stream`` as litdata chunks in ``out`` (in order, one process)."""
    from litdata import TokensLoader, optimize

    items = [
        (str(path), 0, int(b - a), stream.dtype.name)
        for path, a, b in zip(stream.paths, stream.offsets[:-1], stream.offsets[1:], strict=True)
    ]
    optimize(
        fn=_pieces,
        inputs=items,
        output_dir=out,
        chunk_bytes=chunk_bytes,
        item_loader=TokensLoader(),
        num_workers=1,
        keep_data_ordered=True,
        verbose=False,
        start_method="fork",
    )


def ensure_chunks(streams: dict[str, TokenStream], folder: str) -> None:
    """Write the splits' chunks into ``folder`` unless they are there (a remote folder is
    taken as it is). Every rank may call it: one writes each split into a temporary folder
    and renames it into place, under a lock; the others wait and find it."""
    if is_remote(folder):
        return
    for split, stream in streams.items():
        out = Path(folder) / split
        with locked(out.with_name(f".{split}.lock")):
            if (out / "index.json").exists():
                continue
            log.info("data: writing the %s split as litdata chunks in %s", split, out)
            tmp = out.with_name(f".{split}.part")
            shutil.rmtree(tmp, ignore_errors=True)
            write_chunks(stream, str(tmp))
            shutil.rmtree(out, ignore_errors=True)  # a folder without its index: cut short
            tmp.rename(out)


def to_ids(window: Tensor) -> tuple[Tensor, Tensor]:
    """A stored window (int16 or int32 bits of unsigned ids) as int64 input and target."""
    ids = window.long()
    if window.dtype == torch.int16:
        ids = ids & 0xFFFF
    return ids[:-1], ids[1:]


def streaming_loader(
    folder: str,
    split: str,
    block_size: int,
    batch_size: int,
    num_workers: int,
    seed: int,
    train: bool,
) -> Any:
    """litdata's loader over ``folder/split``: windows of ``block_size`` + 1 tokens,
    shuffled by ``seed`` for training."""
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    try:
        dataset = StreamingDataset(
            f"{folder.rstrip('/')}/{split}",
            item_loader=TokensLoader(block_size=block_size + 1),
            shuffle=train,
            drop_last=train,
            seed=seed,
            transform=to_ids,
        )
    except Exception as exc:  # litdata's own: no index, no access to the bucket
        raise ConfigError(
            f"data.stream_dir={folder}: cannot read litdata chunks of the {split} split "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); give the folder the "
            "corpus was written to (data.backend=litdata writes <prepared folder>/litdata)"
        ) from None
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
