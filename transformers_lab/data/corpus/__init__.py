"""Any text as a language model's corpus: sources read as documents (``sources``),
tokenizers (``tokenizer``), a preparation into token shards made once (``prepare``),
windows of them mapped by every rank in a resumable order (``windows``), and the data
module (``module``: ``data=corpus``)."""

from transformers_lab.data.corpus.module import CorpusDataModule, corpora_dir
from transformers_lab.data.corpus.tokenizer import build_tokenizer, tokenizer_from_state

__all__ = ["CorpusDataModule", "build_tokenizer", "corpora_dir", "tokenizer_from_state"]
