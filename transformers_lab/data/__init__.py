"""LightningDataModules for real and synthetic data (one per ``conf/data`` option), their
tokenizers, verified atomic downloads (``download``), and what they share (``base``: the
IGNORE label, the ``TextData`` protocol, the resumable training loader)."""

from transformers_lab.data.corpus import CorpusDataModule
from transformers_lab.data.download import data_root, ensure_file
from transformers_lab.data.lra import ListOpsDataModule, PathfinderDataModule
from transformers_lab.data.mad import MAD_PROBLEMS, MADDataModule
from transformers_lab.data.needles import NeedleDataModule
from transformers_lab.data.synthetic import SyntheticDataModule, copy_or_sort, mqar
from transformers_lab.data.text import ShakespeareBPEDataModule, ShakespeareCharDataModule
from transformers_lab.data.tokenizers import (
    CharTokenizer,
    TiktokenTokenizer,
    WordTokenizer,
    load_encoding,
)
from transformers_lab.data.translation import TranslationDataModule
from transformers_lab.data.vision import DigitsDataModule, FashionMNISTDataModule, MNISTDataModule
from transformers_lab.errors import DataFileError

__all__ = [
    "CharTokenizer",
    "CorpusDataModule",
    "DataFileError",
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "ListOpsDataModule",
    "MADDataModule",
    "MAD_PROBLEMS",
    "MNISTDataModule",
    "NeedleDataModule",
    "PathfinderDataModule",
    "ShakespeareBPEDataModule",
    "ShakespeareCharDataModule",
    "SyntheticDataModule",
    "TiktokenTokenizer",
    "TranslationDataModule",
    "WordTokenizer",
    "copy_or_sort",
    "data_root",
    "ensure_file",
    "load_encoding",
    "mqar",
]
