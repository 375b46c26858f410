"""Translation pairs: Multi30k (task 1, en <-> de) and IWSLT 2017 TED files."""

from __future__ import annotations

import functools
import gzip
import html
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from transformers_lab.data.base import DataModule, ResumableLoader
from transformers_lab.data.download import data_root, ensure_file
from transformers_lab.data.tokenizers import (
    CharTokenizer,
    TiktokenTokenizer,
    WordTokenizer,
    check_encoding,
    load_encoding,
)
from transformers_lab.errors import DataFileError, at_least

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
MULTI30K_FILES = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}
MULTI30K_SPLITS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
LANGUAGES = ("en", "de")
TOKENIZERS = ("char", "word", "tiktoken")


def read_lines(path: Path) -> list[str]:
    """Lines of a text file, gzip'd or not, without their newlines."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


_TAG_LINE = re.compile(
    r"^\s*</?(url|keywords|speaker|talkid|title|description|reviewer|translator|doc|"
    r"transcript|seg)\b"
)
_SEG = re.compile(r"<seg[^>]*>(.*?)</seg>", re.DOTALL)


def read_iwslt_train(path: Path) -> list[str]:
    """Sentences of an IWSLT ``train.tags.*`` file: every line but the metadata tags."""
    return [line.strip() for line in read_lines(path) if not _TAG_LINE.match(line)]


def read_iwslt_xml(path: Path) -> list[str]:
    """Sentences of an IWSLT ``IWSLT17.*.xml`` dev/test file: the ``<seg>`` contents,
    with XML entities decoded."""
    text = path.read_text(encoding="utf-8")
    return [html.unescape(" ".join(m.group(1).split())) for m in _SEG.finditer(text)]


class PairDataset(Dataset):
    """Tokenised (source, target) pairs: source + EOS, and BOS + target + EOS."""

    def __init__(self, src: list[list[int]], tgt: list[list[int]]) -> None:
        if len(src) != len(tgt):
            raise ValueError(f"{len(src)} source lines but {len(tgt)} target lines")
        self.src, self.tgt = src, tgt

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.src[i], self.tgt[i]


def pad_batch(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Pad sources and targets to the longest of the batch: (B, S) and (B, T)."""

    def pad(seqs: list[list[int]]) -> Tensor:
        out = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
        for row, seq in enumerate(seqs):
            out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        return out

    src, tgt = zip(*batch, strict=True)
    return pad(list(src)), pad(list(tgt))


class BucketBatchSampler(BatchSampler):
    """Batches of similar lengths (less padding): the wrapped sampler's indices are cut into
    pools of ``bucket`` batches, each pool is sorted by length and batched, and the
    batches are shuffled. As a ``BatchSampler``, Lightning can swap the wrapped sampler
    for a ``DistributedSampler`` under DDP."""

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool = False,
        *,
        lengths: Sequence[int],
        bucket: int = 50,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.lengths, self.bucket = lengths, bucket

    def __iter__(self) -> Iterator[list[int]]:
        order = list(self.sampler)
        pool, size = self.batch_size * self.bucket, self.batch_size
        batches = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start : start + pool], key=self.lengths.__getitem__)
            batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        if self.drop_last:
            batches = [batch for batch in batches if len(batch) == size]
        return iter([batches[i] for i in torch.randperm(len(batches)).tolist()])


class TranslationDataModule(DataModule):
    """Parallel sentences for the encoder-decoder, tokenised with BOS, EOS and PAD.

    Args:
        dataset: ``multi30k`` (downloaded, checksummed gzip files in ``<root>/multi30k``)
            or ``iwslt2017`` (files the user provides in ``<root>/iwslt2017``:
            ``train.tags.<s>-<t>.<lang>`` and ``IWSLT17.TED.{dev,tst}2010.<s>-<t>.<lang>.xml``).
        src_lang, tgt_lang: ``en`` -> ``de`` or ``de`` -> ``en``.
        tokenizer: ``char`` (one vocabulary over both languages' training text), ``word``
            (the training text's words seen at least ``min_freq`` times, other words
            spelled in characters; about 4x shorter sequences than ``char``) or
            ``tiktoken`` (``encoding``, shared by both sides).
        block_size: the longest tokenised sentence kept, BOS and EOS included: the
            model's context (longer training pairs are dropped, longer evaluation pairs
            truncated).
        batch_size, bucket: batching; ``bucket`` > 0 groups training pairs of similar
            length (pools of ``bucket`` batches), 0 shuffles plainly.
    """

    def __init__(
        self,
        root: str | None = None,
        dataset: str = "multi30k",
        src_lang: str = "en",
        tgt_lang: str = "de",
        tokenizer: str = "char",
        encoding: str = "gpt2",
        bpe_file: str | None = None,
        min_freq: int = 5,
        block_size: int = 256,
        batch_size: int = 64,
        bucket: int = 50,
        num_workers: int = 0,
        download: bool = True,
    ) -> None:
        super().__init__()
        at_least(1, block_size=block_size, batch_size=batch_size)
        at_least(0, num_workers=num_workers)
        if dataset not in ("multi30k", "iwslt2017"):
            raise ValueError(f"unknown dataset {dataset!r}; valid ones are: multi30k, iwslt2017")
        if {src_lang, tgt_lang} != set(LANGUAGES):
            raise ValueError(
                f"src_lang={src_lang!r}, tgt_lang={tgt_lang!r}: expected en -> de or de -> en"
            )
        if tokenizer not in TOKENIZERS:
            raise ValueError(
                f"unknown tokenizer {tokenizer!r}; valid ones are: {', '.join(TOKENIZERS)}"
            )
        if min_freq < 1:
            raise ValueError(
                f"min_freq must be >= 1 (a word's count to be a token), got {min_freq}"
            )
        if tokenizer == "tiktoken":
            check_encoding(encoding, bpe_file)  # before the sentences are fetched
        self.root, self.dataset = data_root(root), dataset
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.tokenizer_kind, self.encoding, self.bpe_file = tokenizer, encoding, bpe_file
        self.min_freq = min_freq
        self.block_size, self.batch_size, self.bucket = block_size, batch_size, bucket
        self.num_workers, self.download = num_workers, download
        self.tokenizer: Any = None
        self.sets: dict[str, PairDataset] = {}
        self.raw: dict[str, tuple[list[str], list[str]]] = {}

    # ------------------------------------------------------------------ files

    def prepare_data(self) -> None:
        if self.dataset == "multi30k":
            folder = self.root / "multi30k"
            for name, sha in MULTI30K_FILES.items():
                ensure_file(folder / name, MULTI30K_URL + name, sha, download=self.download)

    def iwslt_paths(self, split: str, lang: str) -> Path:
        folder, pair = self.root / "iwslt2017", f"{self.src_lang}-{self.tgt_lang}"
        if split == "train":
            return folder / f"train.tags.{pair}.{lang}"
        return folder / f"IWSLT17.TED.{'dev' if split == 'val' else 'tst'}2010.{pair}.{lang}.xml"

    def read_split(self, split: str) -> tuple[list[str], list[str]]:
        """Raw (source, target) sentences of ``train``, ``val`` or ``test``."""
        sides = []
        for lang in (self.src_lang, self.tgt_lang):
            if self.dataset == "multi30k":
                sides.append(
                    read_lines(self.root / "multi30k" / f"{MULTI30K_SPLITS[split]}.{lang}.gz")
                )
                continue
            path = self.iwslt_paths(split, lang)
            if not path.exists():
                raise DataFileError(
                    f"{path} is missing: IWSLT 2017 is not downloaded automatically; place the "
                    "files from the IWSLT 2017 TED release (https://wit3.fbk.eu) there"
                )
            sides.append(read_iwslt_train(path) if split == "train" else read_iwslt_xml(path))
        return sides[0], sides[1]

    # ------------------------------------------------------------------ tokens

    def build_tokenizer(self, texts: list[str]) -> Any:
        if self.tokenizer_kind == "char":
            return CharTokenizer("".join(texts), specials=True)
        if self.tokenizer_kind == "word":
            return WordTokenizer.from_texts(texts, self.min_freq, specials=True)
        return TiktokenTokenizer(load_encoding(self.encoding, self.bpe_file), specials=True)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of a sentence; the char and word tokenizers drop characters they never
        saw in training (rare letters of the validation and test sets)."""
        if self.tokenizer_kind == "tiktoken":
            return self.tokenizer.encode(text)
        return self.tokenizer.encode("".join(c for c in text if c in self.tokenizer.stoi))

    def setup(self, stage: str | None = None) -> None:
        if self.sets:
            return
        self.prepare_data()
        self.raw = {split: self.read_split(split) for split in ("train", "val", "test")}
        if self.tokenizer is None:
            self.tokenizer = self.build_tokenizer([*self.raw["train"][0], *self.raw["train"][1]])
        bos, eos = self.tokenizer.special_id("<bos>"), self.tokenizer.special_id("<eos>")
        longest = self.block_size - 2  # room for BOS and EOS
        for split, (src_lines, tgt_lines) in self.raw.items():
            if len(src_lines) != len(tgt_lines):
                raise DataFileError(
                    f"{self.dataset} {split}: {len(src_lines)} {self.src_lang} lines but "
                    f"{len(tgt_lines)} {self.tgt_lang} lines; the files are not aligned"
                )
            pairs = [
                (self.tokenize(s), self.tokenize(t))
                for s, t in zip(src_lines, tgt_lines, strict=True)
            ]
            if split == "train":  # drop over-long training pairs instead of cutting them
                pairs = [(s, t) for s, t in pairs if len(s) <= longest and len(t) <= longest]
            src = [[*s[:longest], eos] for s, _ in pairs]
            tgt = [[bos, *t[:longest], eos] for _, t in pairs]
            self.sets[split] = PairDataset(src, tgt)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.special_id("<pad>")

    def model_keys(self) -> set[str]:
        return {"src_vocab_size", "tgt_vocab_size", "block_size", "pad_id", "bos_id", "eos_id"}

    def model_kwargs(self) -> dict[str, int]:
        """What the encoder-decoder needs from this data."""
        self.setup()
        v = self.tokenizer.vocab_size
        return {
            "src_vocab_size": v,
            "tgt_vocab_size": v,
            "block_size": self.block_size,
            "pad_id": self.pad_id,
            "bos_id": self.tokenizer.special_id("<bos>"),
            "eos_id": self.tokenizer.special_id("<eos>"),
        }

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of target ids, stopping at EOS."""
        eos = self.tokenizer.special_id("<eos>")
        ids = list(ids)
        return self.tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids)

    # ------------------------------------------------------------------ loaders

    def _loader(self, split: str, train: bool) -> DataLoader:
        self.setup()
        data = self.sets[split]

        collate = functools.partial(pad_batch, pad_id=self.pad_id)  # picklable for workers
        if train and self.bucket > 0:
            lengths = [len(s) for s in data.src]
            batches = BucketBatchSampler(
                RandomSampler(data), self.batch_size, lengths=lengths, bucket=self.bucket
            )
            return ResumableLoader(
                data, batch_sampler=batches, collate_fn=collate, num_workers=self.num_workers
            )
        return (ResumableLoader if train else DataLoader)(
            data,
            batch_size=self.batch_size,
            shuffle=train,
            collate_fn=collate,
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)

    def state_dict(self) -> dict[str, Any]:
        return {"tokenizer": self.tokenizer.state_dict()} if self.tokenizer else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = state.get("tokenizer")
        if not meta or meta["kind"] == "tiktoken":
            return
        if meta["kind"] == "char":
            self.tokenizer = CharTokenizer(meta["chars"], specials=True)
        else:
            self.tokenizer = WordTokenizer(meta["words"], meta["chars"], specials=True)
        self.tokenizer_kind = meta["kind"]
        self.sets = {}  # re-encode the splits with the checkpoint's vocabulary
