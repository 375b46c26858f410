"""The tokenizers a corpus is prepared with: characters, a tiktoken encoding (by name, or
offline from its ranks file), a Hugging Face ``tokenizer.json``, or a sentencepiece model.

Each is rebuilt from its ``state_dict()`` alone (the checkpoint keeps it, so a checkpoint
needs no file beside it), and each has an ``eot_id``: the end-of-text token that joins
documents. A tokenizer without one of its own gets one appended after its vocabulary.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers_lab.data.tokenizers import (
    CharTokenizer,
    check_encoding,
    encoding_from_ranks,
    load_encoding,
)
from transformers_lab.errors import DataFileError

EOT = "<|endoftext|>"
# names of an end-of-text (or end-of-sequence) token in Hugging Face vocabularies
HF_EOT_NAMES = (EOT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class CorpusTokenizer:
    """Text <-> ids, with an end-of-text id; subclasses set ``kind`` and ``base`` (the
    size of the wrapped vocabulary) and implement ``_encode``, ``_decode`` and ``_state``."""

    kind = ""
    base = 0
    own_eot: int | None = None  # the wrapped vocabulary's own end-of-text id, if any
    eot = True  # documents are joined by an end-of-text token (False: plainly concatenated)

    @property
    def eot_id(self) -> int | None:
        """The id that ends each document (None where documents are only concatenated)."""
        if not self.eot:
            return None
        return self.base if self.own_eot is None else self.own_eot

    @property
    def vocab_size(self) -> int:
        return self.base + (self.eot and self.own_eot is None)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; the end-of-text token and ids past the vocabulary are dropped."""
        return self._decode([int(i) for i in ids if i != self.eot_id and 0 <= i < self.base])

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self._state(), "eot": self.eot}

    def fingerprint(self) -> str:
        """A short digest of everything that decides the ids: the cache key's half."""
        text = json.dumps(json_state(self.state_dict()), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return self.kind

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError


def json_state(state: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer's state as JSON can hold it: its bytes (a model or ranks file) as
    ``{"base64": ...}``; ``tokenizer_from_state`` takes either form."""
    return {
        k: {"base64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
        for k, v in state.items()
    }


class Chars(CorpusTokenizer):
    """One id per distinct character of the corpus, sorted (``CharTokenizer``'s ids)."""

    kind = "char"

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = CharTokenizer(chars)
        self.base = self.chars.vocab_size

    def _encode(self, text: str) -> list[int]:
        return self.chars.encode(text)

    def _decode(self, ids: list[int]) -> str:
        return self.chars.decode(ids)

    def _state(self) -> dict[str, Any]:
        return {"chars": self.chars.chars, "specials": []}


class Tiktoken(CorpusTokenizer):
    """A tiktoken encoding; ``ranks`` (a ``.tiktoken`` file's bytes) makes it offline."""

    kind = "tiktoken"

    def __init__(self, encoding: str, ranks: bytes | None = None, where: str = "") -> None:
        check_encoding(encoding, bpe_file="given" if ranks is not None else None)
        self.encoding_name, self.ranks = encoding, ranks
        if ranks is None:
            self.encoding = load_encoding(encoding)
        else:
            self.encoding = encoding_from_ranks(encoding, ranks, where or "the ranks file")
        self.base = self.encoding.n_vocab
        self.own_eot = self.encoding._special_tokens.get(EOT)

    def _encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def _decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def _state(self) -> dict[str, Any]:
        return {"encoding": self.encoding_name, "ranks": self.ranks}

    def describe(self) -> str:
        return f"tiktoken {self.encoding_name}"


class HuggingFace(CorpusTokenizer):
    """A Hugging Face ``tokenizers`` tokenizer from its ``tokenizer.json`` text; no special
    tokens are added, and decoding keeps what the ids spell."""

    kind = "huggingface"

    def __init__(self, json_text: str) -> None:
        from tokenizers import Tokenizer

        self.json_text = json_text
        self.tokenizer = Tokenizer.from_str(json_text)
        # ids run to the largest one, whatever gaps a vocabulary has
        self.base = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        found = (self.tokenizer.token_to_id(name) for name in HF_EOT_NAMES)
        self.own_eot = next((i for i in found if i is not None), None)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        batch = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in batch]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _state(self) -> dict[str, Any]:
        return {"json": self.json_text}


class SentencePiece(CorpusTokenizer):
    """A sentencepiece model from its ``.model`` file's bytes; its ``</s>`` ends a text."""

    kind = "sentencepiece"

    def __init__(self, model: bytes) -> None:
        import sentencepiece

        self.model = model
        self.processor = sentencepiece.SentencePieceProcessor(model_proto=model)
        self.base = self.processor.get_piece_size()
        eos = self.processor.eos_id()
        self.own_eot = eos if eos >= 0 else None

    def _encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.processor.encode(list(texts))

    def _decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids)

    def _state(self) -> dict[str, Any]:
        return {"model": self.model}


def read_tokenizer_file(path: Path, what: str, key: str = "data.tokenizer") -> bytes:
    """A tokenizer file's bytes, or one line that names the file and the fix."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DataFileError(
            f"{key}: the {what} {path} does not exist; give the path of an existing file "
            "(relative paths are read from the directory tlab-train runs in)"
        ) from None
    except OSError as exc:
        raise DataFileError(f"{key}: cannot read the {what} {path}: {exc.strerror}") from None


def build_tokenizer(
    spec: str, chars: Iterable[str] | None = None, bpe_file: str | None = None, eot: bool = True
) -> CorpusTokenizer:
    """The tokenizer ``spec`` names: ``char`` (its characters given by ``chars``), a
    tiktoken encoding's name (offline with ``bpe_file``, a ``.tiktoken`` ranks file), a
    Hugging Face ``tokenizer.json`` or a sentencepiece ``.model`` file; ``eot``: documents
    end with an end-of-text token."""
    tokenizer = _build(spec, chars, bpe_file)
    tokenizer.eot = eot
    return tokenizer


def _build(spec: str, chars: Iterable[str] | None, bpe_file: str | None) -> CorpusTokenizer:
    if spec == "char":
        if chars is None:
            raise ValueError("a character tokenizer is built from the corpus's characters")
        return Chars(chars)
    path = Path(str(spec)).expanduser()
    if path.suffix == ".json":
        data = read_tokenizer_file(path, "Hugging Face tokenizer file")
        try:
            return HuggingFace(data.decode("utf-8"))
        except Exception as exc:  # the tokenizers library's own parse error
            raise DataFileError(
                f"data.tokenizer: {path} is not a Hugging Face tokenizer.json "
                f"({str(exc).splitlines()[0][:160]}); save one with tokenizer.save(path)"
            ) from None
    if path.suffix == ".model":
        data = read_tokenizer_file(path, "sentencepiece model")
        try:
            return SentencePiece(data)
        except Exception as exc:
            raise DataFileError(
                f"data.tokenizer: {path} is not a sentencepiece model "
                f"({str(exc).splitlines()[0][:160]})"
            ) from None
    if path.suffix == ".tiktoken":
        where = f"data.tokenizer={spec}"
        return Tiktoken(path.stem, read_tokenizer_file(path, "tiktoken ranks file"), where)
    if "/" in str(spec) or path.suffix:
        raise ValueError(
            f"data.tokenizer={spec!r} is no tokenizer: give char, a tiktoken encoding's name "
            "(gpt2, cl100k_base), or a file: a Hugging Face tokenizer.json, a sentencepiece "
            ".model or a tiktoken .tiktoken ranks file"
        )
    if bpe_file is None:
        return Tiktoken(str(spec))
    ranks = read_tokenizer_file(Path(bpe_file).expanduser(), "tiktoken ranks file", "data.bpe_file")
    return Tiktoken(str(spec), ranks, f"bpe_file={bpe_file}")


def tokenizer_from_state(state: dict[str, Any]) -> CorpusTokenizer:
    """The tokenizer a ``state_dict()`` describes (a checkpoint's, or ``json_state``'s of a
    prepared corpus); a state from before ``eot`` was saved (Tiny Shakespeare's) joins
    nothing."""
    state = {
        k: base64.b64decode(v["base64"]) if isinstance(v, dict) and "base64" in v else v
        for k, v in state.items()
    }
    kind = state.get("kind")
    if kind == "char":
        tokenizer: CorpusTokenizer = Chars(state["chars"])
    elif kind == "tiktoken":
        tokenizer = Tiktoken(state["encoding"], state.get("ranks"))
    elif kind == "huggingface":
        tokenizer = HuggingFace(state["json"])
    elif kind == "sentencepiece":
        tokenizer = SentencePiece(state["model"])
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r} in a saved state")
    tokenizer.eot = bool(state.get("eot", False))
    return tokenizer
