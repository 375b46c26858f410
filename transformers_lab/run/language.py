"""A checkpoint's language model with the text it reads: what ``tlab-sample``, the harness
of ``tlab-eval`` and ``tlab-export`` take from a restored checkpoint, or one line that
says why this checkpoint is not one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers_lab.data.base import TextData
from transformers_lab.data.corpus.tokenizer import CorpusTokenizer
from transformers_lab.errors import ConfigError
from transformers_lab.models import GPT
from transformers_lab.run.components import Restored


@dataclass
class LanguageModel:
    """A GPT (weights loaded, eval mode) and its data module (``tokenize``, ``detokenize``)."""

    model: GPT
    data: Any

    @property
    def tokenizer(self) -> CorpusTokenizer | None:
        """The corpus tokenizer it trained with (None for a data module without one)."""
        found = getattr(self.data, "tokenizer", None)
        return found if isinstance(found, CorpusTokenizer) else None

    @property
    def prefix(self) -> int:
        """The token a text is read after when nothing precedes it: the end-of-text token
        that ends each training document, else a newline where it is one token (Tiny
        Shakespeare's characters), else id 0."""
        tokenizer = self.tokenizer
        if tokenizer is not None and tokenizer.eot_id is not None:
            return tokenizer.eot_id
        try:
            newline = self.data.tokenize("\n")
        except ValueError:  # a character vocabulary without one
            return 0
        return newline[0] if len(newline) == 1 else 0


def language_model(restored: Restored, ckpt_path: str, what: str) -> LanguageModel:
    """The restored checkpoint's GPT and text data, or a refusal that names ``what`` needs
    them (``tlab-sample``, ``the harness``, ``tlab-export``)."""
    model, data = restored.task.model, restored.datamodule
    if not isinstance(model, GPT) or getattr(model, "bottleneck", None) is not None:
        held = type(model).__name__ + (" with a bottleneck" if isinstance(model, GPT) else "")
        raise ConfigError(
            f"ckpt_path={ckpt_path} holds a {held}, not a language model: {what} takes "
            "a GPT checkpoint (model=gpt) trained on text"
        )
    if not isinstance(data, TextData):
        raise ConfigError(
            f"ckpt_path={ckpt_path} was trained on {type(data).__name__}, which has no text "
            f"tokenizer: {what} takes checkpoints trained on text (data=corpus, "
            "shakespeare_char, shakespeare_bpe)"
        )
    return LanguageModel(model.eval(), data)
