"""What the data modules share: the label of a position with nothing to predict, the
protocol of data made of text, and a training loader that a resumed run continues in the
middle of an epoch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

IGNORE = -100  # the label of a position with nothing to predict: the loss skips it


@runtime_checkable
class TextData(Protocol):
    """A data module of text, with the tokenizer it was built with: what ``tlab-sample``
    and ``tlab-translate`` feed a model, and what a task shows ids as."""

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...


class ResumableLoader(DataLoader):
    """A training DataLoader that a resumed run continues in the middle of an epoch.

    Its state is torch's random state from which the epoch's order was drawn and the
    number of batches handed out (Lightning fetches no batch ahead from a loader with a
    length, so these are the batches trained on). After ``load_state_dict`` the next
    iterator draws the same order again and skips those batches (loaded and
    dropped), then leaves the global random state as it found it. Without this, Lightning
    starts a fresh order and the resumed epoch repeats some examples and misses others.
    The iterator starts its work (and draws) at its first batch: Lightning asks for it
    right away, and an iterator never asked draws nothing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.order_state: torch.Tensor | None = None
        self.served = 0
        self.resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        now = torch.get_rng_state()
        resume, self.resume = self.resume, None
        if resume is not None:
            torch.set_rng_state(resume["order_state"])
        self.order_state, self.served = torch.get_rng_state(), 0
        batches = super().__iter__()
        if resume is not None:
            for _ in range(resume["batches"]):
                next(batches)
            self.served = resume["batches"]
            torch.set_rng_state(now)
        for batch in batches:
            self.served += 1
            yield batch

    # Lightning saves and loads these too (it sees a resumable loader), but it restores
    # them only when it builds the loader after the checkpoint, which a schedule that
    # asks for the run's length prevents; ExactResume applies them in any case
    def state_dict(self) -> dict[str, Any]:
        return {"order_state": self.order_state, "batches": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("order_state") is not None and 0 < state["batches"] < len(self):
            self.resume = state


class DataModule(L.LightningDataModule):
    """The base of the project's data modules: a batch already on the CPU (a tuple or list
    of CPU tensors) is handed over as it is when training on the CPU; Lightning would walk
    it, every step. (The hook belongs to the data: defined on the task, Lightning warned at
    every run that the task's overrides the data module's.)"""

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        on_cpu = device.type == "cpu" and isinstance(batch, tuple | list)
        if on_cpu and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in batch):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def model_keys(self) -> set[str]:
        """The keys its ``model_kwargs`` gives a model, known before any data is read (the
        preflight holds them to the model's options); empty where only the data tells."""
        return set()


class InMemoryDataModule(DataModule):
    """A data module whose ``setup`` fills ``train_set`` and ``val_set`` (generated from a
    seed, held in memory) and which loads them at ``batch_size``: the synthetic and MAD
    tasks."""

    train_set: Dataset | None
    val_set: Dataset | None
    batch_size: int
    num_workers: int

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return ResumableLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)
