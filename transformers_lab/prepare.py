"""tlab-prepare: a corpus tokenized once into token shards, with the data config a run
will use, so that the runs (and every node of them) find it prepared. For ``data=corpus``
it loads no torch: a login node prepares as fast as a training node.

tlab-prepare 'data.sources=[my_texts/*.txt]' data.tokenizer=gpt2
tlab-prepare 'data.sources=[corpus.jsonl]' data.tokenizer=tokenizer.json data.prepare_workers=16
"""

from __future__ import annotations

import hydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from transformers_lab.cli import refusals_leave_no_run_dir, run_hydra, user_errors
from transformers_lab.config import CONF_DIR
from transformers_lab.data.corpus import Corpus
from transformers_lab.errors import ConfigError, DataFileError

CORPUS = "transformers_lab.data.CorpusDataModule"
PACKAGE = "transformers_lab.data."
CORPUS_MODULES = ("corpus.module", "text")  # where our corpus and its presets live


def check_corpus_target(target: str) -> None:
    """One of our data modules that holds no corpus is refused from its name, before
    torch is imported to build it (a class of the user's is built to see)."""
    from transformers_lab.data import LAZY

    name = target.removeprefix(PACKAGE)
    module = LAZY.get(name) if target.startswith(PACKAGE) else None
    if module is not None and module not in CORPUS_MODULES:
        raise ConfigError(f"tlab-prepare prepares a corpus (data=corpus), not {name}")


def corpus_of(data: DictConfig) -> Corpus:
    """The corpus a data config names: ``data=corpus``'s own keys, or the ``corpus`` of a
    preset's module (Tiny Shakespeare's)."""
    config = OmegaConf.to_container(data, resolve=True)
    try:
        if config.get("_target_") == CORPUS:
            return Corpus.from_config(config)
        check_corpus_target(str(config.get("_target_")))
        built = instantiate(data)  # a preset's module (this loads torch)
    except InstantiationException as exc:  # Hydra's wrapping of the constructor's refusal
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError | DataFileError):
            raise cause from None
        raise ConfigError(f"data: {str(cause).splitlines()[0]}") from None
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"data: {exc}") from None
    if not isinstance(getattr(built, "corpus", None), Corpus):
        raise ConfigError(
            f"tlab-prepare prepares a corpus (data=corpus), not {type(built).__name__}"
        )
    return built.corpus


def prepare(cfg: DictConfig) -> Corpus:
    """Prepare ``cfg.data`` and say where it is and what it holds."""
    corpus = corpus_of(cfg.data)
    manifest = corpus.ensure_prepared()
    tokens, docs, tokenizer = manifest["tokens"], manifest["documents"], manifest["tokenizer"]
    print(f"prepared: {corpus.folder}")
    print(
        f"  {docs['total']:,} documents, {tokens['train']:,} training and "
        f"{tokens['val']:,} validation tokens ({manifest['dtype']}, "
        f"{len(manifest['shards'])} shards), tokenizer {tokenizer['name']} "
        f"({tokenizer['vocab_size']:,} ids)"
    )
    if not tokens["val"]:
        print(
            "  note: the validation split is empty; a run needs one (data.val_fraction, or "
            "data.split=tail for a corpus of few documents)"
        )
    print(
        f"  train on it: tlab-train model=gpt data=corpus data.prepared={corpus.folder} "
        "data.tokenizer=null"
    )
    return corpus


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="prepare")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors(), refusals_leave_no_run_dir():
        prepare(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
