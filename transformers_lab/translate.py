"""tlab-translate: translate sentences with an encoder-decoder checkpoint of tlab-train.

tlab-translate ckpt_path=logs/train/runs/<time>/checkpoints/best.ckpt text="A man rides a horse."
tlab-translate ckpt_path=... input_file=sentences.txt decode=beam beam_size=5
tlab-translate ckpt_path=...        # no text, no input_file: one sentence a line on stdin

The model and its tokenizer come from the checkpoint of a Transformer trained on
translation data (``tlab-train experiment=transformer_multi30k``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig, ListConfig

from transformers_lab.cli import refusals_leave_no_run_dir, run_hydra, user_errors
from transformers_lab.config import CONF_DIR, migrate_targets
from transformers_lab.errors import ConfigError, at_least, check_beam
from transformers_lab.run.values import check_values, typed_options

if TYPE_CHECKING:
    import lightning as L
    import torch

    from transformers_lab.models import Transformer

# torch, Lightning and the run's code are imported once the options are checked (in the
# functions below): a mistake in a value is refused in about a second

log = logging.getLogger(__name__)

DECODERS = ("greedy", "beam")


WANTED = (
    "tlab-translate needs an encoder-decoder Transformer checkpoint (tlab-train "
    "experiment=transformer_multi30k)"
)


def load_translator(cfg: DictConfig) -> tuple[Transformer, L.LightningDataModule]:
    """The Transformer of the checkpoint (weights loaded) and its data module, tokenizer
    restored."""
    from transformers_lab.models import GPT, Transformer
    from transformers_lab.run.checkpoints import read_checkpoint
    from transformers_lab.run.components import restore, target_class

    checkpoint = read_checkpoint(cfg.ckpt_path, bool(cfg.get("trust_checkpoint")))
    run = checkpoint.run_config(cfg.get("data"))
    found = target_class(run.model)
    if not (isinstance(found, type) and issubclass(found, Transformer)):
        trained_on = str(run.data.get("_target_", "?")).rpartition(".")[2]
        held = f"{cfg.ckpt_path} holds a {found.__name__} trained on {trained_on}"
        gpt = isinstance(found, type) and issubclass(found, GPT)  # the other tool takes it
        other = "; tlab-sample generates text from it" if gpt else ""
        raise ConfigError(f"{WANTED}; {held}{other}")  # before anything is built
    _, datamodule, task = restore(checkpoint, run)
    return task.model, datamodule


@dataclass(frozen=True)
class TranslateOptions:
    """How ``tlab-translate`` decodes (``conf/translate.yaml``), each setting refused here
    or, for the beam, by beam search's rule (``errors.check_beam``)."""

    decode: str = "greedy"
    beam_size: int = 4
    length_penalty: float = 0.6
    max_new_tokens: int | None = 128
    batch_size: int = 32

    def __post_init__(self) -> None:
        if self.decode not in DECODERS:
            raise ValueError(f"unknown decode={self.decode}; valid ones are: {', '.join(DECODERS)}")
        if self.decode == "beam":
            check_beam(self.beam_size)
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens}: a translation needs at least one "
                "token; give max_new_tokens >= 1 (or null for the model's longest)"
            )
        at_least(1, batch_size=self.batch_size)


def given_sentences(cfg: DictConfig) -> list[str] | None:
    """The sentences of ``cfg.text`` or ``cfg.input_file`` (None when neither is given),
    each stripped of surrounding spaces; an empty one is refused, naming where it is."""
    if cfg.text is not None:
        texts = list(cfg.text) if isinstance(cfg.text, ListConfig) else [cfg.text]
        where = ["text"] if len(texts) == 1 else [f"text[{i}]" for i in range(len(texts))]
    elif cfg.input_file is not None:
        path = Path(cfg.input_file)
        if not path.is_file():
            raise ConfigError(
                f"input_file {path} does not exist; give a text file with one sentence per line"
            )
        texts = path.read_text(encoding="utf-8").splitlines()
        where = [f"line {i + 1} of {path}" for i in range(len(texts))]
    else:
        return None
    sentences = [str(text).strip() for text in texts]
    for sentence, name in zip(sentences, where, strict=True):
        if not sentence:
            raise ConfigError(f"{name} is empty; give a sentence to translate")
    if not sentences:
        raise ConfigError("no sentences to translate: the text list or input_file is empty")
    return sentences


def stdin_sentences() -> Iterator[str]:
    """Sentences typed or piped on stdin, one a line; blank lines are skipped."""
    if sys.stdin.isatty():
        print("one sentence a line; Ctrl-D ends", file=sys.stderr, flush=True)
    for line in iter(sys.stdin.readline, ""):
        if line.strip():
            yield line.strip()


def batches(sentences: Iterator[str] | list[str], size: int) -> Iterator[list[str]]:
    """Consecutive lists of ``size`` sentences (the last may be shorter)."""
    batch = []
    for sentence in sentences:
        batch.append(sentence)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def source_ids(sentences: list[str], datamodule: L.LightningDataModule) -> torch.Tensor:
    """Source ids (B, S) as the model was trained on them: the tokens, then EOS, then PAD;
    a sentence longer than the data's ``block_size`` is cut, as in evaluation."""
    import torch

    eos = datamodule.tokenizer.special_id("<eos>")
    longest = datamodule.block_size - 2  # room for BOS and EOS, as in training
    rows = []
    for sentence in sentences:
        ids = datamodule.tokenize(sentence)
        if not ids:
            raise ConfigError(
                f"{sentence!r} encodes to no tokens: none of its characters are in the "
                f"checkpoint's vocabulary"
            )
        if len(ids) > longest:
            log.warning(
                "%r is %d tokens long; translating its first %d", sentence, len(ids), longest
            )
        rows.append([*ids[:longest], eos])
    src = torch.full((len(rows), max(map(len, rows))), datamodule.pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        src[i, : len(row)] = torch.tensor(row)
    return src


def sentences_of(cfg: DictConfig) -> list[str] | None:
    """The sentences given (``given_sentences``), from one place of the two."""
    if cfg.text is not None and cfg.input_file is not None:
        raise ConfigError("give text=... or input_file=..., not both")
    return given_sentences(cfg)


def check_options(cfg: DictConfig) -> None:
    """What needs no torch: the values (``run.values``), the options, and the sentences."""
    check_values(cfg)
    typed_options(TranslateOptions, cfg)
    sentences_of(cfg)


def translate(cfg: DictConfig) -> list[str]:
    """Translations of the sentences of ``cfg.text``, ``cfg.input_file`` or stdin, printed as
    ``source -> translation`` lines and returned."""
    import torch

    with torch.no_grad():
        return translated(cfg)


def translated(cfg: DictConfig) -> list[str]:
    import lightning as L

    from transformers_lab.run.components import use_cpu
    from transformers_lab.run.preflight import check_config

    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    migrate_targets(cfg)  # a _target_ of an earlier version, to its new home
    check_config(cfg)  # the checks every entry point makes: ckpt_path given, device, types
    opts = typed_options(TranslateOptions, cfg)
    sentences = sentences_of(cfg)
    use_cpu(cfg)
    L.seed_everything(cfg.seed)
    model, datamodule = load_translator(cfg)
    model.to(cfg.device)
    # stdin is read a sentence at a time, so each is answered as soon as it is typed
    size = 1 if sentences is None else opts.batch_size
    translations = []
    for batch in batches(stdin_sentences() if sentences is None else sentences, size):
        src = source_ids(batch, datamodule).to(cfg.device)
        if opts.decode == "greedy":
            out = model.greedy(src, opts.max_new_tokens)
        else:
            out = model.beam_search(src, opts.beam_size, opts.max_new_tokens, opts.length_penalty)
        for source, row in zip(batch, out, strict=True):
            translations.append(datamodule.detokenize(row.tolist()))
            print(f"{source} -> {translations[-1]}", flush=True)
    return translations


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="translate")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors(), refusals_leave_no_run_dir():
        check_options(cfg)  # in about a second: torch is not imported yet
        translate(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
