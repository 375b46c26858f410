"""LightningDataModules for real and synthetic data (one per ``conf/data`` option), any
text corpus (``corpus``), their tokenizers, verified atomic downloads (``download``), and
what they share (``base``: the IGNORE label, the ``TextData`` protocol, the resumable
training loader).

The names below are imported when first asked for, so that a tool which needs one part
(``tlab-prepare``: the corpus's preparation) does not load torch and Lightning with the
rest.
"""

from __future__ import annotations

import importlib
from typing import Any

LAZY = {
    "CorpusDataModule": "corpus.module",
    "data_root": "download",
    "ensure_file": "download",
    "ListOpsDataModule": "lra",
    "PathfinderDataModule": "lra",
    "MAD_PROBLEMS": "mad",
    "MADDataModule": "mad",
    "NeedleDataModule": "needles",
    "SyntheticDataModule": "synthetic",
    "copy_or_sort": "synthetic",
    "mqar": "synthetic",
    "ShakespeareBPEDataModule": "text",
    "ShakespeareCharDataModule": "text",
    "CharTokenizer": "tokenizers",
    "TiktokenTokenizer": "tokenizers",
    "WordTokenizer": "tokenizers",
    "load_encoding": "tokenizers",
    "TranslationDataModule": "translation",
    "DigitsDataModule": "vision",
    "FashionMNISTDataModule": "vision",
    "MNISTDataModule": "vision",
}
__all__ = sorted([*LAZY, "DataFileError"])


def __getattr__(name: str) -> Any:
    if name == "DataFileError":
        from transformers_lab.errors import DataFileError

        return DataFileError
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
