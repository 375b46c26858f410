"""A prepared corpus read by every rank without loading it: the shards of a split mapped
into memory as one stream of tokens, windows of it, and the order that training reads
them in, which a resumed run takes up at the batch it stopped before.

The order of an epoch is a function of its seed and the position: position p of the
epoch draws a window offset uniformly (torch's ``RandomSampler`` draws, 32 at a time, from
a generator seeded with the epoch's seed), and under DDP rank r of W takes the positions
p = r, r + W, ... Data loader workers only fetch what the main process's sampler chose, so
the order is the same for any number of them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from transformers_lab.data.base import ResumableLoader
from transformers_lab.errors import ConfigError


class TokenStream:
    """The tokens of one split, its shards read as one array; each process maps the files
    when it first reads (a worker that is forked or spawned maps its own)."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: str, limit: int | None = None):
        kept = [(p, n) for p, n in zip(paths, sizes, strict=True) if n > 0]
        self.paths = [p for p, _ in kept]
        self.offsets = np.cumsum([0] + [n for _, n in kept])
        self.dtype = np.dtype(dtype)
        total = int(self.offsets[-1])
        self.length = total if limit is None else min(total, limit)
        self.maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "maps": None}

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64 (a copy), across shards."""
        if self.maps is None:
            self.maps = [np.memmap(p, dtype=self.dtype, mode="r") for p in self.paths]
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while filled < length:
            at = start + filled - int(self.offsets[shard])
            piece = self.maps[shard][at : at + length - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            shard += 1
        return out


class TokenWindows(Dataset):
    """Windows x = tokens[s : s+T], y = tokens[s+1 : s+T+1] at s = 0, stride, 2 stride...:
    stride 1 for training (any offset), stride T for validation (each target once)."""

    def __init__(
        self, stream: TokenStream, block_size: int, stride: int = 1, split: str = ""
    ) -> None:
        if len(stream) <= block_size:
            raise ConfigError(
                f"data: the {split or 'a'} split has {len(stream)} tokens, too few for one window "
                f"of block_size={block_size} (+1 target); lower data.block_size, or give more "
                "text (or a larger data.val_fraction or data.val_tokens)"
            )
        self.stream, self.block_size, self.stride = stream, block_size, stride

    def __len__(self) -> int:
        return (len(self.stream) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        chunk = torch.from_numpy(self.stream.read(i * self.stride, self.block_size + 1))
        return chunk[:-1], chunk[1:]


def seed_of_epoch(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class WindowOrder(DistributedSampler):
    """``num_samples`` window offsets an epoch, drawn uniformly with replacement, split
    between the ranks. A ``DistributedSampler``, so that Lightning leaves it as it is.

    ``seed``: the epoch's seed is ``seed_of_epoch(seed, epoch)``; ``None`` draws it from
    torch's global random state each time an order starts, as ``RandomSampler`` does (the
    runs of the in-memory text module had this order), or under DDP takes it from the
    run's seed (``torch.initial_seed``) and the epoch, so that every rank has the same
    order whatever each drew before; either is kept for a resume.
    ``num_replicas`` and ``rank`` default to the process group's.
    """

    def __init__(
        self,
        num_windows: int,
        num_samples: int,
        seed: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:  # not DistributedSampler's: no data set, no process group needed to build it
        self.num_windows, self.total, self.seed = num_windows, num_samples, seed
        self.replicas, self.this_rank = num_replicas, rank
        self.epoch, self.epoch_seed, self.skip, self.resuming = 0, None, 0, False

    def world(self) -> tuple[int, int]:
        """(rank, number of ranks)."""
        grouped = dist.is_available() and dist.is_initialized()
        replicas = self.replicas or (dist.get_world_size() if grouped else 1)
        rank = self.this_rank if self.this_rank is not None else (dist.get_rank() if grouped else 0)
        return rank, replicas

    @property
    def num_replicas(self) -> int:  # DistributedSampler's names, for those who read them
        return self.world()[1]

    @property
    def rank(self) -> int:
        return self.world()[0]

    def __len__(self) -> int:
        return math.ceil(self.total / self.world()[1])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "epoch_seed": self.epoch_seed}

    def resume(self, state: dict[str, Any], skip: int) -> None:
        """Take up epoch ``state`` after this rank's first ``skip`` positions."""
        self.epoch, self.epoch_seed, self.skip = state["epoch"], state["epoch_seed"], skip
        self.resuming = True

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        resuming, self.resuming = self.resuming, False
        rank, replicas = self.world()
        if resuming:
            pass
        elif self.seed is not None:
            self.epoch_seed = seed_of_epoch(self.seed, self.epoch)
        elif replicas > 1:  # every rank the same order, whatever each drew before
            self.epoch_seed = seed_of_epoch(torch.initial_seed(), self.epoch)
        else:  # RandomSampler's draw, at the same moment (the first one)
            self.epoch_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        mine = torch.arange(rank + skip * replicas, len(self) * replicas, replicas)
        yield from self.draws()[mine % self.total].tolist()

    def draws(self) -> Tensor:
        """The epoch's window offsets, in order (RandomSampler's blocks of 32)."""
        generator = torch.Generator()
        generator.manual_seed(self.epoch_seed)
        blocks = [32] * (self.total // 32) + [self.total % 32]
        return torch.cat(
            [torch.randint(self.num_windows, (n,), generator=generator) for n in blocks]
        )


class WindowLoader(ResumableLoader):
    """The training loader of a corpus: a resumed run's next batch is the one the run
    that was never stopped took next, fetched with no batch before it read again.

    Its state is the epoch's order (``WindowOrder.state_dict``) and the batches handed out.
    A state of the in-memory text module (torch's random state at the epoch's start)
    resumes too: the epoch's seed is drawn from it as that module drew it.
    """

    sampler: WindowOrder

    def __iter__(self) -> Iterator[Any]:
        resume, self.resume = self.resume, None
        now = torch.get_rng_state()
        if resume is not None:
            order = resume.get("order")
            if order is None:  # the in-memory module's: torch's state when its epoch began
                torch.set_rng_state(resume["order_state"])
                torch.empty((), dtype=torch.int64).random_()  # the loader's base seed
                drawn = int(torch.empty((), dtype=torch.int64).random_().item())
                order = {"epoch": self.sampler.epoch, "epoch_seed": drawn}
            self.sampler.resume(order, resume["batches"] * self.batch_size)
        batches = DataLoader.__iter__(self)
        self.served = 0 if resume is None else resume["batches"]
        if resume is not None:
            torch.set_rng_state(now)  # the checkpoint's random state, as if never stopped
        for batch in batches:
            self.served += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.sampler.state_dict(), "batches": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if 0 < state.get("batches", 0) < len(self):
            self.resume = state
