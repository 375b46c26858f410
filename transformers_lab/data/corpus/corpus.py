"""A corpus as the data config names it, and its preparation: where it goes, with which
tokenizer, found again or made (``prepare``). Plain Python and numpy: ``tlab-prepare``
uses it without torch, and the data module (``module``) around it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from transformers_lab.data.corpus.prepare import (
    Settings,
    corpus_key,
    load_tokenizer,
    prepare,
    read_json,
)
from transformers_lab.data.corpus.sources import SourceFile, resolve_sources
from transformers_lab.data.corpus.tokenizer import CorpusTokenizer, build_tokenizer
from transformers_lab.errors import ConfigError, at_least


def corpora_dir(folder: str | None = None) -> Path:
    """Where prepared corpora go: ``folder``, else ``$TLAB_CORPUS_DIR``, else
    ``~/.cache/transformers_lab/corpora``."""
    if folder is not None:
        return Path(folder).expanduser()
    default = Path("~/.cache/transformers_lab/corpora").expanduser()
    return Path(os.environ.get("TLAB_CORPUS_DIR", default)).expanduser()


@dataclass
class Corpus:
    """The sources, the tokenizer and the split of a corpus (the data config's keys of
    the same names: ``CorpusDataModule`` documents them), and the folder it is prepared in.

    ``tokenizer`` (the built one, once known) is set from a checkpoint's state to prepare
    with it, and from the prepared folder otherwise.
    """

    sources: Any = None
    tokenizer_name: str | None = "gpt2"
    bpe_file: str | None = None
    eot: bool = True
    text_field: str = "text"
    documents: str = "file"
    settings: Settings = field(default_factory=Settings)
    prepared: str | None = None
    prepared_dir: str | None = None
    prepare_workers: int | None = None
    download: bool = True
    tokenizer: CorpusTokenizer | None = None
    folder: Path | None = None
    manifest: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.prepare_workers is not None:
            at_least(1, prepare_workers=self.prepare_workers)
        if not self.sources and self.prepared is None:
            raise ConfigError(
                "data=corpus needs data.sources (files, globs, folders or hf:<name>), e.g. "
                "data.sources=[my_texts/*.txt], or data.prepared=<a prepared corpus's folder>"
            )
        if self.tokenizer_name is None and self.prepared is None:
            raise ConfigError("data.tokenizer is null: name one (char, gpt2, a tokenizer.json)")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Corpus:
        """The corpus of a ``data=corpus`` config (its other keys are the loaders')."""
        settings = Settings(
            **{f.name: config[f.name] for f in fields(Settings) if f.name in config}
        )
        names = {f.name for f in fields(cls)} - {"tokenizer", "folder", "manifest", "settings"}
        given = {k: v for k, v in config.items() if k in names}
        return cls(tokenizer_name=config.get("tokenizer", "gpt2"), settings=settings, **given)

    def files(self) -> list[SourceFile]:
        return resolve_sources(self.sources, self.text_field, self.documents, self.download)

    def wanted_tokenizer(self) -> CorpusTokenizer | None:
        """The tokenizer to prepare with: a checkpoint's, or the config's (None: characters
        of the corpus, found while preparing)."""
        if self.tokenizer is not None:
            return self.tokenizer
        if self.tokenizer_name == "char" or self.tokenizer_name is None:
            return None
        return build_tokenizer(self.tokenizer_name, bpe_file=self.bpe_file, eot=self.eot)

    def ensure_prepared(self) -> dict[str, Any]:
        """The manifest of this corpus, prepared first where it is not (every process may
        call it: one prepares, the others wait for its lock and find the shards)."""
        if self.manifest is not None:
            return self.manifest
        if self.prepared is not None:
            folder = Path(self.prepared).expanduser()
            manifest = read_json(folder / "manifest.json")
            if manifest is None:
                raise ConfigError(
                    f"data.prepared={self.prepared} holds no prepared corpus (no manifest.json); "
                    "prepare one first with data.sources=[...], or give the folder that "
                    "tlab-prepare printed"
                )
            self.check_tokenizer(manifest, folder)
        else:
            files = self.files()
            tokenizer = self.wanted_tokenizer()
            folder = self.folder_for(files, tokenizer)
            if tokenizer is not None and self.tokenizer_name == "char":
                # a checkpoint's characters: the corpus's own preparation where they agree
                own = self.folder_for(files, None)
                made = read_json(own / "manifest.json")
                if made and made["tokenizer"]["fingerprint"] == tokenizer.fingerprint():
                    folder = own
            workers = self.prepare_workers or min(8, os.cpu_count() or 1)
            manifest = prepare(files, tokenizer, self.settings, folder, workers, self.eot)
        self.folder, self.manifest = folder, manifest
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(folder)
        return manifest

    def folder_for(self, files: list[SourceFile], tokenizer: CorpusTokenizer | None) -> Path:
        """The folder of this corpus prepared with ``tokenizer`` (None: the characters of
        the corpus, whatever they are)."""
        identity = tokenizer.fingerprint() if tokenizer else f"char:eot={self.eot}"
        key = corpus_key(files, identity, self.settings)
        name = Path(files[0].path).stem.replace(" ", "_")[:40] or "corpus"
        return corpora_dir(self.prepared_dir) / f"{name}-{key}"

    def check_tokenizer(self, manifest: dict[str, Any], folder: Path) -> None:
        """Refuse a prepared corpus made with another tokenizer than the one asked for (the
        config's, or the checkpoint's)."""
        wanted = self.tokenizer
        if wanted is None and self.tokenizer_name not in (None, "char"):
            wanted = build_tokenizer(self.tokenizer_name, bpe_file=self.bpe_file, eot=self.eot)
        made = manifest["tokenizer"]
        if wanted is None and self.tokenizer_name == "char" and made["kind"] != "char":
            raise ConfigError(
                f"data.prepared={folder} was prepared with the tokenizer {made['name']}, not "
                "by characters as data.tokenizer=char asks; set data.tokenizer=null to use "
                "the prepared one"
            )
        if wanted is not None and wanted.fingerprint() != made["fingerprint"]:
            raise ConfigError(
                f"data.prepared={folder} was prepared with the tokenizer {made['name']} "
                f"({made['vocab_size']} ids), not {wanted.describe()} ({wanted.vocab_size} ids) "
                "as asked; prepare the corpus again with this tokenizer (data.sources=...), or "
                "set data.tokenizer=null to use the prepared one"
            )
