"""tlab-sample: generate text from a GPT checkpoint of tlab-train.

tlab-sample ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt prompt="ROMEO:"
tlab-sample ckpt_path=... num_samples=5 temperature=1.0 top_k=null top_p=0.9
tlab-sample ckpt_path=... stream=false     # print each sample once it is complete
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import hydra
import lightning as L
import torch
from omegaconf import DictConfig

from transformers_lab.cli import run_hydra, user_errors
from transformers_lab.config import CONF_DIR
from transformers_lab.data.base import TextData
from transformers_lab.errors import ConfigError
from transformers_lab.models import GPT
from transformers_lab.run.build import use_cpu_threads
from transformers_lab.run.checkpoints import restore
from transformers_lab.run.preflight import check_config


def load_generator(cfg: DictConfig) -> tuple[GPT, L.LightningDataModule]:
    """The GPT of the checkpoint (weights loaded) and the data module with its tokenizer."""
    _, datamodule, task = restore(cfg.ckpt_path, cfg.get("data"))
    if not isinstance(datamodule, TextData):
        raise ConfigError(
            f"the checkpoint's data ({type(datamodule).__name__}) has no text tokenizer to "
            f"sample with; tlab-sample takes checkpoints trained on text (shakespeare_char, "
            f"shakespeare_bpe)"
        )
    if not isinstance(task.model, GPT):
        raise ConfigError(
            f"tlab-sample needs a GPT checkpoint; {cfg.ckpt_path} holds a "
            f"{type(task.model).__name__}"
        )
    return task.model, datamodule


# what a decoder writes for bytes that do not (yet) make a whole UTF-8 character
REPLACEMENT = "\ufffd"


class TextStream:
    """The text of a growing token sequence, handed out piece by piece.

    Each ``push`` decodes the whole sequence so far and returns the text that is new since
    the last piece. A byte-level BPE token may hold only part of a multi-byte character,
    which decodes to U+FFFD until the rest arrives; such a tail is held back, so no
    piece ever shows a broken character. ``finish`` hands out what is left, and the
    pieces then add up to ``decode(ids)``. This relies on the decoder being prefix-stable
    (more tokens never change the text of the whole characters before them), as the
    char, word and tiktoken decoders are.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""  # the pieces handed out so far

    def push(self, ids: Sequence[int]) -> str:
        """The new text that ``ids``, appended to the sequence, complete."""
        self.ids += ids
        piece = self.decode(self.ids)[len(self.text) :].rstrip(REPLACEMENT)
        self.text += piece
        return piece

    def finish(self) -> str:
        """The rest of the text: the held-back tail (U+FFFD if it never completed)."""
        piece = self.decode(self.ids)[len(self.text) :]
        self.text += piece
        return piece


def encode_prompt(datamodule: L.LightningDataModule, prompt: str) -> list[int]:
    """The prompt's ids in the checkpoint's vocabulary; a ``ConfigError`` names what is
    missing from it."""
    try:
        ids = datamodule.tokenize(prompt)
    except ValueError as exc:  # a character the char tokenizer was not built on
        raise ConfigError(
            f"prompt={prompt!r} cannot be encoded: {exc}; the model knows only the "
            f"characters of its training text, so write the prompt with those"
        ) from None
    if not ids:
        raise ConfigError("the prompt encodes to no tokens; give prompt=<some text>")
    return ids


@torch.no_grad()
def sample(cfg: DictConfig) -> list[str]:
    """``cfg.num_samples`` continuations of ``cfg.prompt``, printed and returned; with
    ``cfg.stream`` each is printed as its tokens are drawn."""
    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    check_config(cfg)
    if cfg.max_new_tokens is None:
        raise ConfigError("max_new_tokens=null: give the number of tokens to sample")
    use_cpu_threads(cfg)
    L.seed_everything(cfg.seed)
    model, datamodule = load_generator(cfg)
    model.to(cfg.device)
    ids = encode_prompt(datamodule, cfg.prompt)
    if len(ids) > model.block_size:  # GPT.stream keeps the last block_size tokens
        print(
            f"note: the prompt has {len(ids)} tokens, more than the model's context of "
            f"{model.block_size}: the model sees only its last {model.block_size} tokens",
            file=sys.stderr,
            flush=True,
        )
    prompt = torch.tensor([ids], dtype=torch.long, device=cfg.device)
    options = {
        "temperature": cfg.temperature,
        "top_k": cfg.top_k,
        "top_p": cfg.top_p,
        "use_cache": cfg.use_cache,
    }
    texts = []
    for _ in range(cfg.num_samples):
        start = time.perf_counter()
        if cfg.stream:
            pieces = TextStream(datamodule.detokenize)
            print(pieces.push(ids), end="", flush=True)
            for next_id in model.stream(prompt, cfg.max_new_tokens, **options):
                print(pieces.push(next_id.tolist()), end="", flush=True)
            print(pieces.finish())
            texts.append(pieces.text)
        else:
            out = model.generate(prompt, cfg.max_new_tokens, **options)
            texts.append(datamodule.detokenize(out[0].tolist()))
            print(texts[-1])
        seconds = time.perf_counter() - start
        rate = cfg.max_new_tokens / seconds if seconds > 0 else float("inf")
        print(f"{cfg.max_new_tokens} tokens in {seconds:.2f} s: {rate:.0f} tokens/s",
              file=sys.stderr, flush=True)  # fmt: skip
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
