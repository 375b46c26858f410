"""Language modelling on any corpus: ``data=corpus``.

Its sources are tokenized once into token shards (``prepare``), which every rank maps and
reads windows of (``windows``); the tokenizer is saved with the shards and in every
checkpoint, so a checkpoint decodes with nothing beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import DataLoader

from transformers_lab.data.base import DataModule
from transformers_lab.data.corpus import stream
from transformers_lab.data.corpus.corpus import Corpus
from transformers_lab.data.corpus.prepare import Settings
from transformers_lab.data.corpus.tokenizer import CorpusTokenizer, tokenizer_from_state
from transformers_lab.data.corpus.windows import (
    TokenStream,
    TokenWindows,
    WindowLoader,
    WindowOrder,
)
from transformers_lab.errors import ConfigError, at_least

BACKENDS = ("mmap", "litdata")


class CorpusDataModule(DataModule):
    """Next-token prediction on the text of ``sources``, prepared once into token shards.

    Training batches are windows at random offsets of the training split
    (``train_samples`` an epoch, in an order set by ``order_seed``, split between DDP
    ranks); validation batches are contiguous windows of the first ``val_tokens`` tokens
    of the validation split (all of it where null).

    Args:
        sources: text files, globs or folders, ``.jsonl``/``.json``/``.parquet`` files,
            ``hf:<name>`` or a saved data set's folder; or mappings ``{path: ..., field:
            ..., documents: ..., format: ...}``.
        tokenizer: ``char``, a tiktoken encoding (``gpt2``), a Hugging Face
            ``tokenizer.json`` or a sentencepiece ``.model``; null with ``prepared``: the
            prepared corpus's.
        bpe_file: a local ``.tiktoken`` ranks file for a tiktoken encoding (offline).
        eot: end each document with an end-of-text token.
        text_field: the field of JSON, the column of Parquet and data sets, with the text.
        documents: a text file is one document (``file``) or one a blank-line block
            (``paragraphs``).
        split, val_fraction, split_seed: how documents go to validation (``Settings``).
        val_tokens: the validation budget in tokens (null: the whole split).
        prepared: a prepared corpus's folder, read as it is (no sources needed).
        prepared_dir: where preparations go (``corpora_dir``).
        block_size: tokens per window (the model's context).
        batch_size: windows per batch.
        train_samples: training windows an epoch.
        order_seed: the seed of the training order; null draws each epoch's seed from the
            run's seeded random state (under DDP: from the run's seed, the same on every
            rank), as the in-memory text module drew its order.
        num_workers: DataLoader workers.
        prepare_workers: processes that tokenize (null: the CPU count, at most 8).
        chunk_bytes, shard_bytes: the text of a task and of a shard.
        backend: ``mmap`` (the shards mapped into memory) or ``litdata`` (the tokens
            streamed as litdata chunks from ``stream_dir``: ``corpus.stream``).
        stream_dir: the litdata chunks' folder, local or ``s3://...`` (null: ``litdata``
            in the prepared folder, written there once).
        download: fetch a source that has a url and is missing.
    """

    def __init__(
        self,
        sources: Any = None,
        tokenizer: str | None = "gpt2",
        bpe_file: str | None = None,
        eot: bool = True,
        text_field: str = "text",
        documents: str = "file",
        split: str = "documents",
        val_fraction: float = 0.01,
        split_seed: int = 0,
        val_tokens: int | None = None,
        prepared: str | None = None,
        prepared_dir: str | None = None,
        block_size: int = 256,
        batch_size: int = 12,
        train_samples: int = 12_000,
        order_seed: int | None = None,
        num_workers: int = 0,
        prepare_workers: int | None = None,
        chunk_bytes: int = 4 << 20,
        shard_bytes: int = 256 << 20,
        backend: str = "mmap",
        stream_dir: str | None = None,
        download: bool = True,
    ) -> None:
        super().__init__()
        at_least(1, block_size=block_size, batch_size=batch_size, train_samples=train_samples)
        at_least(0, num_workers=num_workers)
        if val_tokens is not None:
            at_least(1, val_tokens=val_tokens)
        if backend not in BACKENDS:
            raise ConfigError(f"data.backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(sources, ListConfig | DictConfig):  # as Hydra gives it: plain lists, dicts
            sources = OmegaConf.to_container(sources, resolve=True)
        self.corpus = Corpus(
            sources=sources,
            tokenizer_name=tokenizer,
            bpe_file=bpe_file,
            eot=eot,
            text_field=text_field,
            documents=documents,
            settings=Settings(split, val_fraction, split_seed, chunk_bytes, shard_bytes),
            prepared=prepared,
            prepared_dir=prepared_dir,
            prepare_workers=prepare_workers,
            download=download,
        )
        self.val_tokens, self.block_size, self.batch_size = val_tokens, block_size, batch_size
        self.train_samples, self.order_seed = train_samples, order_seed
        self.num_workers = num_workers
        self.backend, self.stream_dir = backend, stream_dir
        self.streams: dict[str, TokenStream] = {}

    # ----- the prepared corpus (``Corpus``) -----

    @property
    def tokenizer(self) -> CorpusTokenizer | None:
        """The checkpoint's tokenizer, or the prepared corpus's."""
        return self.corpus.tokenizer

    @property
    def folder(self) -> Path | None:
        return self.corpus.folder

    @property
    def manifest(self) -> dict[str, Any] | None:
        return self.corpus.manifest

    def prepare_data(self) -> None:
        self.corpus.ensure_prepared()

    def ensure_prepared(self) -> dict[str, Any]:
        return self.corpus.ensure_prepared()

    def setup(self, stage: str | None = None) -> None:
        if self.streams:
            return
        manifest = self.ensure_prepared()
        assert self.folder is not None
        streams = {}
        for split in ("train", "val"):
            shards = manifest["shards"]
            paths = [self.folder / s[split]["file"] for s in shards]
            sizes = [s[split]["tokens"] for s in shards]
            limit = self.val_tokens if split == "val" else None
            streams[split] = TokenStream(paths, sizes, manifest["dtype"], limit)
            if len(streams[split]) <= self.block_size:
                raise ConfigError(self.too_short(split, len(streams[split]), manifest))
        self.streams = streams

    def too_short(self, split: str, tokens: int, manifest: dict[str, Any]) -> str:
        """Why a split of ``tokens`` holds no window, and what to change."""
        if not sum(manifest["tokens"].values()):
            return f"data.sources hold no text ({self.corpus.sources}): every document is empty"
        name, docs = ("validation" if split == "val" else "training"), manifest["documents"]
        fix = "lower data.block_size or give more text"
        if split == "val":
            fix = "lower data.block_size, or raise data.val_fraction or data.val_tokens"
        if self.corpus.settings.split == "documents" and docs[split] < 10:
            fix += (
                f" (the split holds {docs[split]} of {docs['total']} documents: each goes "
                "whole to one split; data.split=tail splits each document instead)"
            )
        return (
            f"data: the {name} split of {self.folder} has {tokens} tokens, too few for one "
            f"window of block_size={self.block_size} (+1 target); {fix}"
        )

    # ----- what a model and the entry points need -----

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None or self.manifest is None:
            self.setup()
        return self.tokenizer.vocab_size

    def model_keys(self) -> set[str]:
        return {"vocab_size", "block_size"}

    def model_kwargs(self) -> dict[str, int]:
        """What a language model needs from this data."""
        return {"vocab_size": self.vocab_size, "block_size": self.block_size}

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

    def streamed(self, split: str) -> DataLoader:
        """litdata's loader of ``split`` (its chunks written first where they are not)."""
        folder = self.stream_dir or str(self.folder / "litdata")
        stream.ensure_chunks(self.streams, folder)
        train = split == "train"
        seed = self.order_seed if self.order_seed is not None else 0  # litdata's own: a number
        return stream.streaming_loader(
            folder, split, self.block_size, self.batch_size, self.num_workers, seed, train
        )

    def train_dataloader(self) -> DataLoader:
        self.setup()
        if self.backend == "litdata":
            return self.streamed("train")
        windows = TokenWindows(self.streams["train"], self.block_size, split="training")
        order = WindowOrder(len(windows), self.train_samples, self.order_seed)
        return WindowLoader(
            windows, batch_size=self.batch_size, sampler=order, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        if self.backend == "litdata":
            return self.streamed("val")
        windows = TokenWindows(
            self.streams["val"], self.block_size, stride=self.block_size, split="validation"
        )
        return DataLoader(windows, batch_size=self.batch_size, num_workers=self.num_workers)

    # ----- the checkpoint's part -----

    def state_dict(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer.state_dict()} if self.tokenizer else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's tokenizer: the corpus is read (prepared where needed) with it."""
        saved = state.get("tokenizer")
        if not saved:
            return
        bpe_file = self.corpus.bpe_file
        if saved["kind"] == "tiktoken" and saved.get("ranks") is None and bpe_file:
            # saved by name (the in-memory text module's), read offline from the ranks file
            saved = {**saved, "ranks": Path(bpe_file).expanduser().read_bytes()}
        self.corpus.tokenizer = tokenizer_from_state(saved)
        self.corpus.manifest, self.streams = None, {}
