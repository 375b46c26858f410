"""tlab-export: a GPT checkpoint as a Hugging Face transformers model.

    tlab-export ckpt_path=logs/train/runs/<time>/checkpoints/best.ckpt out=exports/baby_gpt

The folder holds ``model.safetensors``, ``config.json`` (the model's recipe: its Hydra
config with the sizes the data gave), ``generation_config.json``, the tokenizer it trained
with, and ``modeling_tlab.py``, whose classes ``AutoModelForCausalLM`` and
``AutoTokenizer`` load with ``trust_remote_code=True`` (``transformers_lab.hf``)::

    model = AutoModelForCausalLM.from_pretrained("exports/baby_gpt", trust_remote_code=True)

The harness's own model reads it too: ``lm_eval --model hf --model_args
pretrained=exports/baby_gpt,trust_remote_code=True``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from transformers_lab.cli import refusals_leave_no_run_dir, run_hydra, user_errors
from transformers_lab.config import CONF_DIR, expand_hybrid, migrate_targets
from transformers_lab.errors import ConfigError
from transformers_lab.run.checkpoints import read_checkpoint
from transformers_lab.run.components import model_kwargs, restore, use_cpu
from transformers_lab.run.language import language_model


def package_version() -> str:
    try:
        return version("transformers_lab")
    except PackageNotFoundError:
        return ""


def export_checkpoint(cfg: DictConfig) -> Path:
    """Write ``cfg.ckpt_path``'s GPT and tokenizer to the new folder ``cfg.out``."""
    from transformers_lab.hf.write import check_out, export

    migrate_targets(cfg)
    out = Path(str(cfg.out)).expanduser()
    check_out(out)
    checkpoint = read_checkpoint(cfg.ckpt_path, bool(cfg.get("trust_checkpoint")))
    use_cpu(cfg)
    run = checkpoint.run_config(cfg.get("data"))
    restored = restore(checkpoint, run)
    found = language_model(restored, cfg.ckpt_path, "tlab-export")
    if found.tokenizer is None:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path}: its data ({type(found.data).__name__}) keeps no "
            "tokenizer to export; train on data=corpus or shakespeare_char"
        )
    recipe = OmegaConf.to_container(expand_hybrid(run.model), resolve=True)
    recipe.update(model_kwargs(run.model, restored.datamodule))
    written = export(
        found.model.float(), recipe, found.tokenizer, found.prefix, out, package_version()
    )
    print(f"checkpoint: {cfg.ckpt_path} (epoch {checkpoint.epoch}, step {checkpoint.step})")
    print(f"exported: {written}")
    print(
        "load it: AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True), "
        "AutoTokenizer likewise (transformers_lab installed: the model is built by our code)"
    )
    return written


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="export")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors(), refusals_leave_no_run_dir():
        export_checkpoint(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
