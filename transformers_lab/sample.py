"""tlab-sample: generate text from a GPT checkpoint of tlab-train.

tlab-sample ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt prompt="ROMEO:"
tlab-sample ckpt_path=... num_samples=5 temperature=1.0 top_k=null top_p=0.9
"""

from __future__ import annotations

import hydra
import lightning as L
import torch
from omegaconf import DictConfig

from transformers_lab.builders import (
    CONF_DIR,
    ConfigError,
    build_datamodule,
    build_model,
    check_checkpoint,
    load_checkpoint,
)
from transformers_lab.cli import run_hydra, user_errors
from transformers_lab.eval import saved_run


def load_generator(cfg: DictConfig) -> tuple[torch.nn.Module, L.LightningDataModule]:
    """The GPT of the checkpoint (weights loaded) and the data module with its tokenizer."""
    checkpoint = load_checkpoint(cfg.ckpt_path)
    run = saved_run(checkpoint, cfg.ckpt_path, cfg.get("data"))
    datamodule = build_datamodule(run.data)
    state = checkpoint.get(type(datamodule).__qualname__)
    if state:
        datamodule.load_state_dict(state)
    if not hasattr(datamodule, "encode") or not hasattr(datamodule, "decode"):
        raise ConfigError(
            f"the checkpoint's data ({type(datamodule).__name__}) has no text tokenizer to "
            f"sample with; tlab-sample takes checkpoints trained on text (shakespeare_char, "
            f"shakespeare_bpe)"
        )
    model = build_model(run.model, datamodule)
    if not hasattr(model, "generate"):
        raise ConfigError(
            f"tlab-sample needs a GPT checkpoint; {cfg.ckpt_path} holds a {type(model).__name__}"
        )
    wrapper = torch.nn.Module()
    wrapper.model = model  # the task's parameter names are "model.*"
    check_checkpoint(checkpoint, wrapper, cfg.ckpt_path)
    wrapper.load_state_dict(checkpoint["state_dict"])
    return model.eval(), datamodule


@torch.no_grad()
def sample(cfg: DictConfig) -> list[str]:
    """``cfg.num_samples`` continuations of ``cfg.prompt``, printed and returned."""
    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    L.seed_everything(cfg.seed)
    model, datamodule = load_generator(cfg)
    model.to(cfg.device)
    ids = datamodule.encode(cfg.prompt)
    if not ids:
        raise ConfigError("the prompt encodes to no tokens; give prompt=<some text>")
    prompt = torch.tensor([ids], dtype=torch.long, device=cfg.device)
    texts = []
    for _ in range(cfg.num_samples):
        out = model.generate(
            prompt,
            cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            use_cache=cfg.use_cache,
        )
        texts.append(datamodule.decode(out[0].tolist()))
        print(texts[-1])
        print("-" * 40, flush=True)
    return texts


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="sample")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors():
        sample(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
