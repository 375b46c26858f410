"""Our corpus tokenizers (characters, tiktoken, a Hugging Face ``tokenizer.json``,
sentencepiece) as a transformers tokenizer: ``TlabTokenizer`` encodes and decodes with
the very tokenizer the model trained with, rebuilt from its saved state
(``tlab_tokenizer.json``), so that the export reads text as training did.

A token's string is its id in decimal ("65"). The end-of-text token that ends each
training document is the export's end-of-sequence token, named ``<|endoftext|>``; a
tokenizer without one (Tiny Shakespeare's characters) gets one past its vocabulary
(``generate`` and the harness's ``HFLM`` need one), which the model never writes and
reads as its prefix token (``tlab_prefix_token_id``, a newline there): ``HFLM`` reads a
text with no context after the end-of-sequence token, as ``TlabLM`` reads it after the
prefix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizer

from transformers_lab.data.corpus.tokenizer import (
    EOT,
    CorpusTokenizer,
    json_state,
    tokenizer_from_state,
)

TOKENIZER_FILE = "tlab_tokenizer.json"


def write_tokenizer_state(tokenizer: CorpusTokenizer, path: Path) -> None:
    """The tokenizer's state as ``TlabTokenizer`` reads it."""
    path.write_text(json.dumps(json_state(tokenizer.state_dict())))


def end_of_text(tokenizer: CorpusTokenizer) -> int:
    """The export's end-of-sequence id: the tokenizer's end of text, else the id past its
    vocabulary."""
    eot = tokenizer.eot_id
    return tokenizer.vocab_size if eot is None else eot


class TlabTokenizer(PreTrainedTokenizer):
    """``AutoTokenizer``'s class for an export of ``tlab-export``."""

    vocab_files_names = {"state_file": TOKENIZER_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, state_file: str | None = None, **kwargs: Any) -> None:
        if state_file is None:
            raise ValueError(f"a TlabTokenizer is read from its {TOKENIZER_FILE}")
        state = json.loads(Path(state_file).read_text())
        self.inner = tokenizer_from_state(state)
        self.state = state
        self.eos_id = end_of_text(self.inner)
        self.names = {EOT: self.eos_id}
        kwargs.setdefault("eos_token", EOT)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("padding_side", "left")  # generation pads prompts on the left
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return {**{str(i): i for i in range(self.inner.vocab_size)}, **self.names}

    def __len__(self) -> int:
        return max(self.inner.vocab_size, self.eos_id + 1)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [str(i) for i in self.inner.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self.names:
            return self.names[token]
        return int(token) if token.isdigit() else self.unk_token_id

    def _convert_id_to_token(self, index: int) -> str:
        return EOT if index == self.eos_id else str(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """The text of the tokens; the end-of-sequence token, where it is kept
        (``skip_special_tokens=False``), as its name: the harness stops at that text."""
        pieces, run = [], []
        for token in [*tokens, None]:
            if token is None or token == EOT:
                pieces.append(self.inner.decode(run))
                pieces.append(EOT if token else "")
                run = []
            else:
                run.append(self._convert_token_to_id(token))
        return "".join(pieces)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple:
        name = f"{filename_prefix}-{TOKENIZER_FILE}" if filename_prefix else TOKENIZER_FILE
        path = Path(save_directory) / name
        path.write_text(json.dumps(self.state))
        return (str(path),)
