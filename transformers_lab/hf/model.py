"""Our GPT as a Hugging Face transformers model: ``TlabConfig`` and ``TlabForCausalLM``.

The config holds the model's own recipe (``tlab_model``: its Hydra config with the sizes
the data gave, ``_target_`` and all), so every kernel, position encoding and layer part
is rebuilt exactly as it trained; the weights are its ``state_dict`` under ``gpt.``.

``generate`` decodes on our own ``models.gpt.Decoder``, the object ``GPT.stream``
steps through, carried between steps as the generation's cache (``TlabState``): a KV
cache, or the recurrent state of a linear or gated kernel, past ``block_size`` as our
decoding goes. Greedy decoding on the export is ours token by token (the tests hold it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import get_object, instantiate
from torch import Tensor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from transformers_lab.models.gpt import GPT, Decoder

MODEL_TYPE = "tlab_gpt"


class TlabConfig(PretrainedConfig):
    """A GPT of ours: ``tlab_model``, its recipe (the model's Hydra config, sizes
    included); ``tied``, the parameter names the LM head shares with the embedding;
    ``tlab_prefix_token_id``, the token a text is read after when nothing precedes it;
    ``tlab_end_of_text``, the tokenizer's end-of-sequence id where it is past the
    vocabulary, read as that prefix token."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        tlab_model: dict[str, Any] | None = None,
        vocab_size: int = 0,
        max_position_embeddings: int = 0,
        tied: dict[str, str] | None = None,
        tlab_version: str = "",
        tlab_prefix_token_id: int = 0,
        tlab_end_of_text: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.tlab_model = tlab_model or {}
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings  # the harness's max_length
        self.tied = tied or {}
        self.tlab_version = tlab_version
        self.tlab_prefix_token_id = tlab_prefix_token_id  # read before a text with no context
        self.tlab_end_of_text = tlab_end_of_text  # the tokenizer's end of sequence past the
        # vocabulary (a tokenizer without one of its own): read as the prefix token
        kwargs.setdefault("tie_word_embeddings", bool(self.tied))
        super().__init__(**kwargs)


@dataclass
class TlabOutput(ModelOutput):
    """The logits, the loss where labels were given, and the decoding state (``cache``,
    as transformers 5 names it)."""

    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: Any = None


class TlabState:
    """The decoding state ``generate`` carries between steps: our ``Decoder`` for the
    batch, or one per row of a left-padded batch (the harness's ``HFLM`` pads prompts of
    different lengths on the left), each row read from its first token, its pads never."""

    def __init__(self, gpt: GPT, mask: Tensor | None, use_cache: bool) -> None:
        self.read = 0  # the columns of input_ids fed so far, pads included
        self.pads = left_pads(mask)
        count = 1 if self.pads is None else len(self.pads)
        self.decoders = [Decoder(gpt, use_cache) for _ in range(count)]

    def feed(self, ids: Tensor) -> Tensor:
        """The logits of the columns ``ids`` (B, n): each row's, where it has them (the
        last ``block_size`` where its context is read again), zero over its pads."""
        start, n = self.read, ids.shape[1]
        self.read += n
        if self.pads is None:
            return self.decoders[0].feed(ids)
        out = None
        for row, (decoder, pad) in enumerate(zip(self.decoders, self.pads, strict=True)):
            skip = max(0, pad - start)
            if skip >= n:
                continue
            logits = decoder.feed(ids[row : row + 1, skip:])
            if out is None:
                out = logits.new_zeros(ids.shape[0], n, logits.shape[-1])
            out[row, n - logits.shape[1] :] = logits[0]
        if out is None:
            raise ValueError("every row of this batch is padding: give each at least one token")
        return out


def left_pads(mask: Tensor | None) -> list[int] | None:
    """Each row's count of pads before its tokens, or None where no row has any; a mask
    with pads after a row's tokens or between them is refused."""
    if mask is None or bool(mask.all()):
        return None
    mask = mask.bool()
    pads = (~mask).long().cumprod(-1).sum(-1)
    for row, pad in zip(mask, pads.tolist(), strict=True):
        if not bool(row[pad:].all()):
            raise ValueError(
                "this export decodes left-padded rows (tokenizer.padding_side='left'); a row "
                "has padding after its first token"
            )
    return pads.tolist()


def right_padded(mask: Tensor) -> bool:
    """Whether every row's pads come after all of its tokens (or it has none)."""
    mask = mask.bool()
    ones = mask.long().cumprod(-1).sum(-1)
    return bool((mask.sum(-1) == ones).all())


def build_gpt(recipe: dict[str, Any]) -> GPT:
    """The GPT a recipe describes, on the CPU with real tensors: its buffers (position
    tables, ALiBi slopes, decays) are computed where it is built, not loaded."""
    target = get_object(str(recipe.get("_target_", "")))
    if not (isinstance(target, type) and issubclass(target, GPT)):
        raise TypeError(f"the recipe's _target_ {recipe.get('_target_')!r} is not a GPT")
    with torch.device("cpu"):
        return instantiate(recipe, _convert_="all")


def unsaved_buffers(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """(name, buffer) of the buffers that are not in the ``state_dict``."""
    return [
        (f"{owner}.{key}" if owner else key, module._buffers[key])
        for owner, module in model.named_modules()
        for key in sorted(module._non_persistent_buffers_set)
        if module._buffers.get(key) is not None
    ]


class TlabForCausalLM(PreTrainedModel, GenerationMixin):
    """``AutoModelForCausalLM``'s class for an export of ``tlab-export``."""

    config_class = TlabConfig
    base_model_prefix = "gpt"
    main_input_name = "input_ids"

    def __init__(self, config: TlabConfig) -> None:
        super().__init__(config)
        self.gpt = build_gpt(config.tlab_model)
        # what the GPT computes as it is built and does not save (position tables, ALiBi
        # slopes, decays), kept to put back after from_pretrained empties them
        self._computed = {k: b.detach().clone() for k, b in unsaved_buffers(self.gpt)}
        self._tied_weights_keys = {f"gpt.{k}": f"gpt.{v}" for k, v in config.tied.items()}
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``from_pretrained``, then the buffers the GPT computed as it was
        built put back: transformers leaves the buffers it does not load uninitialised."""
        model = super().from_pretrained(*args, **kwargs)
        model.restore_buffers()
        return model

    def restore_buffers(self) -> None:
        for name, module_buffer in unsaved_buffers(self.gpt):
            owner, _, key = name.rpartition(".")
            module = self.gpt.get_submodule(owner)
            computed = self._computed[name]
            module._buffers[key] = computed.to(module_buffer.device, module_buffer.dtype)

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: the GPT initialises itself, and the weights are loaded over it."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the state is ours (TlabState), made by the first forward

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.gpt.tok

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.gpt.lm_head

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        cache: Any = None,
        generating: bool = False,
        **kwargs: Any,
    ) -> TlabOutput:
        """Logits (B, T, vocab) of ``input_ids``. In ``generate`` the tokens are read on
        the decoding state (``TlabState``, our decoding with or without ``use_cache``),
        which comes back as ``cache``. Called alone, the whole input is read at once, at
        most ``block_size`` tokens where the model's positions end there; right-padded
        rows are read as they are (a causal model's logits do not depend on what follows),
        left-padded ones a row at a time. The tokenizer's end-of-sequence token, where it
        is past the vocabulary, is read as the prefix token (``tlab_prefix_token_id``)."""
        ids = self.readable(input_ids)
        state = cache if isinstance(cache, TlabState) else None
        if state is None and generating:
            state = TlabState(self.gpt, attention_mask, use_cache=use_cache is not False)
        if state is not None:
            logits = state.feed(ids)
        elif attention_mask is None or right_padded(attention_mask):
            logits = self.read_whole(ids)
        else:
            logits = TlabState(self.gpt, attention_mask, use_cache=False).feed(ids)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return TlabOutput(loss=loss, logits=logits, cache=state)

    def readable(self, input_ids: Tensor) -> Tensor:
        """The ids the GPT reads: the end-of-sequence token past its vocabulary as the
        prefix token."""
        extra = self.config.tlab_end_of_text
        if extra is None:
            return input_ids
        return input_ids.masked_fill(input_ids == extra, self.config.tlab_prefix_token_id)

    def read_whole(self, ids: Tensor) -> Tensor:
        reach = self.gpt.reach(ids.shape[1])
        if ids.shape[1] > self.gpt.block_size and reach is not None:
            raise ValueError(f"this model cannot read {ids.shape[1]} tokens: {reach}")
        return self.gpt(ids)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, one sequence a prompt: beams would reorder the
        decoding state, which is ours."""
        for key in ("num_beams", "num_return_sequences"):
            if int(kwargs.get(key) or 1) > 1:
                raise ValueError(
                    f"{key}={kwargs[key]}: this export decodes one sequence a prompt on its own "
                    "decoding state (greedy or sampled); give each prompt its own row"
                )
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The tokens the state has not read yet, and the state."""
        state = cache if isinstance(cache, TlabState) else None
        if state is not None:
            input_ids = input_ids[:, state.read :]
        inputs = {"input_ids": input_ids, "use_cache": use_cache, "cache": state}
        inputs["generating"] = True
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        return inputs
