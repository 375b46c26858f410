"""tlab-sample: generate text from a GPT checkpoint of tlab-train.

tlab-sample ckpt_path=logs/train/runs/<time>/checkpoints/last.ckpt prompt="ROMEO:"
tlab-sample ckpt_path=... num_samples=5 temperature=1.0 top_k=null top_p=0.9
tlab-sample ckpt_path=... stream=false     # print each sample once it is complete
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

from transformers_lab.cli import refusals_leave_no_run_dir, run_hydra, user_errors
from transformers_lab.config import CONF_DIR, migrate_targets
from transformers_lab.errors import ConfigError, at_least, check_sampling
from transformers_lab.run.values import check_values, typed_options

if TYPE_CHECKING:
    import lightning as L

    from transformers_lab.models import GPT

# torch, Lightning and the run's code are imported once the options are checked (in the
# functions below): a mistake in a value is refused in about a second


@dataclass(frozen=True)
class SampleOptions:
    """What ``tlab-sample`` draws (``conf/sample.yaml``), each setting refused here or, for
    the sampling itself, by the model's rule (``errors.check_sampling``)."""

    prompt: str = "\n"
    num_samples: int = 3
    max_new_tokens: int = 300
    temperature: float = 0.8
    top_k: int | None = 200
    top_p: float | None = None
    use_cache: bool = True
    stream: bool = True

    def __post_init__(self) -> None:
        at_least(1, num_samples=self.num_samples, max_new_tokens=self.max_new_tokens)
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def drawing(self) -> dict[str, Any]:
        """The options of ``GPT.generate`` and ``GPT.stream``."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "use_cache": self.use_cache,
        }


def load_generator(cfg: DictConfig) -> tuple[GPT, L.LightningDataModule]:
    """The GPT of the checkpoint (weights loaded) and the data module with its tokenizer."""
    from transformers_lab.run.checkpoints import read_checkpoint
    from transformers_lab.run.components import restore
    from transformers_lab.run.language import language_model

    checkpoint = read_checkpoint(cfg.ckpt_path, bool(cfg.get("trust_checkpoint")))
    restored = restore(checkpoint, checkpoint.run_config(cfg.get("data")))
    found = language_model(restored, cfg.ckpt_path, "tlab-sample")
    return found.model, found.data


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


def sample(cfg: DictConfig) -> list[str]:
    """The samples ``cfg``'s options ask for (``SampleOptions``): continuations of the
    prompt, printed and returned; streamed, each is printed as its tokens are drawn."""
    import torch

    with torch.no_grad():
        return draw(cfg)


def draw(cfg: DictConfig) -> list[str]:
    import lightning as L
    import torch

    from transformers_lab.run.components import use_cpu
    from transformers_lab.run.preflight import check_config

    print(f"run dir: {cfg.paths.output_dir}", flush=True)
    migrate_targets(cfg)  # a _target_ of an earlier version, to its new home
    check_config(cfg)
    opts = typed_options(SampleOptions, cfg)
    use_cpu(cfg)
    L.seed_everything(cfg.seed, verbose=False)  # stdout holds the samples alone
    model, datamodule = load_generator(cfg)
    model.to(cfg.device)
    ids = encode_prompt(datamodule, opts.prompt)
    limit = model.decode_limit() if opts.use_cache else "use_cache=false"
    # GPT.stream crops once the context holds more than block_size tokens to read
    if limit and len(ids) + opts.max_new_tokens - 1 > model.block_size:
        print(
            f"note: {len(ids)} prompt tokens and {opts.max_new_tokens} new ones pass the "
            f"model's context of {model.block_size} ({limit}): past it the model sees only "
            f"the last {model.block_size} tokens, re-encoded at each step",
            file=sys.stderr,
            flush=True,
        )
    prompt = torch.tensor([ids], dtype=torch.long, device=cfg.device)
    texts = []
    for _ in range(opts.num_samples):
        start = time.perf_counter()
        if opts.stream:
            pieces = TextStream(datamodule.detokenize)
            print(pieces.push(ids), end="", flush=True)
            for next_id in model.stream(prompt, opts.max_new_tokens, **opts.drawing):
                print(pieces.push(next_id.tolist()), end="", flush=True)
            print(pieces.finish())
            texts.append(pieces.text)
        else:
            out = model.generate(prompt, opts.max_new_tokens, **opts.drawing)
            texts.append(datamodule.detokenize(out[0].tolist()))
            print(texts[-1])
        seconds = time.perf_counter() - start
        rate = opts.max_new_tokens / seconds if seconds > 0 else float("inf")
        print(f"{opts.max_new_tokens} tokens in {seconds:.2f} s: {rate:.0f} tokens/s",
              file=sys.stderr, flush=True)  # fmt: skip
        print("-" * 40, flush=True)
    return texts


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="sample")
def hydra_main(cfg: DictConfig) -> None:
    with user_errors(), refusals_leave_no_run_dir():
        check_values(cfg)  # in about a second: torch is not imported yet
        typed_options(SampleOptions, cfg)
        sample(cfg)


def main() -> None:
    run_hydra(hydra_main)


if __name__ == "__main__":
    main()
