"""Any text as a language model's corpus: sources read as documents (``sources``),
tokenizers (``tokenizer``), a preparation into token shards made once (``prepare``,
``corpus``), windows of them mapped by every rank in a resumable order (``windows``),
litdata's streaming (``stream``), and the data module (``module``: ``data=corpus``).

``CorpusDataModule`` is imported when first asked for: the preparation alone needs no
torch."""

from __future__ import annotations

from typing import Any

from transformers_lab.data.corpus.corpus import Corpus, corpora_dir
from transformers_lab.data.corpus.tokenizer import build_tokenizer, tokenizer_from_state

__all__ = ["Corpus", "CorpusDataModule", "build_tokenizer", "corpora_dir", "tokenizer_from_state"]


def __getattr__(name: str) -> Any:
    if name == "CorpusDataModule":
        from transformers_lab.data.corpus.module import CorpusDataModule

        return CorpusDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
