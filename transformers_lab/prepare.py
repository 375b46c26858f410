"""tlab-prepare: a corpus tokenized once into token shards, with the data config a run
will use, so that the runs (and every node of them) find it prepared.

tlab-prepare 'data.sources=[my_texts/*.txt]' data.tokenizer=gpt2
tlab-prepare 'data.sources=[corpus.jsonl]' data.tokenizer=tokenizer.json data.prepare_workers=16
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from transformers_lab.cli import run_hydra, user_errors
from transformers_lab.config import CONF_DIR
from transformers_lab.data.corpus import CorpusDataModule
from transformers_lab.errors import ConfigError
from transformers_lab.run.build import build_datamodule
from transformers_lab.run.preflight import check_config


def prepare(cfg: DictConfig) -> CorpusDataModule:
    """Prepare ``cfg.data`` (a corpus) and say where it is and what it holds."""
    check_config(cfg)
    datamodule = build_datamodule(cfg.data)
    if not isinstance(datamodule, CorpusDataModule):
        raise ConfigError(
            f"tlab-prepare prepares a corpus (data=corpus), not {type(datamodule).__name__}"
        )
    manifest = datamodule.ensure_prepared()
    tokens, docs = manifest["tokens"], manifest["documents"]
    print(f"prepared: {datamodule.folder}")
    print(
        f"  {docs['train'] + docs['val']:,} documents, {tokens['train']:,} training and "
        f"{tokens['val']:,} validation tokens ({manifest['dtype']}, "
        f"{len(manifest['shards'])} shards), tokenizer {manifest['tokenizer']['name']} "
        f"({manifest['tokenizer']['vocab_size']:,} ids)"
    )
    print(
        f"  train on it: tlab-train model=gpt data=corpus data.prepared={datamodule.folder} "
        "data.tokenizer=null"
    )
    return datamodule


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="prepare")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        prepare(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
