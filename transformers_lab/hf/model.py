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
from hydra.utils import instantiate
from torch import Tensor
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from transformers_lab.models.gpt import GPT, Decoder

MODEL_TYPE = "tlab_gpt"


class TlabConfig(PretrainedConfig):
    """A GPT of ours: ``tlab_model``, its recipe (the model's Hydra config, sizes
    included); ``tied``, the parameter names the LM head shares with the embedding;
    ``tlab_prefix_token_id``, the token a text is read after when nothing precedes it."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        tlab_model: dict[str, Any] | None = None,
        vocab_size: int = 0,
        max_position_embeddings: int = 0,
        tied: dict[str, str] | None = None,
        tlab_version: str = "",
        tlab_prefix_token_id: int = 0,
        **kwargs: Any,
    ) -> None:
        self.tlab_model = tlab_model or {}
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings  # the harness's max_length
        self.tied = tied or {}
        self.tlab_version = tlab_version
        self.tlab_prefix_token_id = tlab_prefix_token_id  # read before a text with no context
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
    """The decoding state ``generate`` carries between steps: our ``Decoder``."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    @property
    def read(self) -> int:
        return self.decoder.read


def build_gpt(recipe: dict[str, Any]) -> GPT:
    """The GPT a recipe describes, on the CPU with real tensors: its buffers (position
    tables, ALiBi slopes, decays) are computed where it is built, not loaded."""
    with torch.device("cpu"):
        model = instantiate(recipe, _convert_="all")
    if not isinstance(model, GPT):
        raise TypeError(f"the recipe builds a {type(model).__name__}, not a GPT")
    return model


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
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> TlabOutput:
        """Logits (B, T, vocab) of ``input_ids``. With ``use_cache`` (``generate``) the
        tokens are read on the decoding state, which comes back as ``cache``; without,
        the whole input is read at once (at most ``block_size`` tokens where the model's
        positions end there). Padding is refused: every row is read whole."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "this export reads every token of every row: give unpadded rows (batch_size=1 "
                "for rows of different lengths)"
            )
        state = cache if isinstance(cache, TlabState) else past_key_values
        if not isinstance(state, TlabState):
            state = None
        if state is None and not use_cache:
            reach = self.gpt.reach(input_ids.shape[1])
            if input_ids.shape[1] > self.gpt.block_size and reach is not None:
                raise ValueError(f"this model cannot read {input_ids.shape[1]} tokens: {reach}")
            logits = self.gpt(input_ids)
        else:
            state = state or TlabState(Decoder(self.gpt, use_cache=True))
            logits = state.decoder.feed(input_ids)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return TlabOutput(loss=loss, logits=logits, cache=state)

    @torch.no_grad()
    def generate(
        self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, **kwargs: Any
    ) -> Any:
        """transformers' ``generate``; a left-padded batch (the harness's ``HFLM`` pads
        prompts of different lengths) is decoded a row at a time, each row unpadded, and
        put back in its place: the new tokens start at the padded prompt's end, the rows
        padded after their end. ``max_length`` counts from the padded prompt, as for the
        batch; a row's stopping criteria are its end-of-sequence and ``max_length``."""
        if input_ids is None or attention_mask is None or bool(attention_mask.all()):
            return super().generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        width = input_ids.shape[1]
        if "max_length" in kwargs and "max_new_tokens" not in kwargs:
            kwargs["max_new_tokens"] = kwargs.pop("max_length") - width
        kwargs.pop("stopping_criteria", None)  # made for the batch; the harness cuts at stops
        pad = kwargs.get("pad_token_id", self.generation_config.pad_token_id)
        pad = self.config.eos_token_id if pad is None else pad
        rows = []
        for ids, mask in zip(input_ids, attention_mask.bool(), strict=True):
            new = super().generate(input_ids=ids[mask][None], **kwargs)[0, int(mask.sum()) :]
            rows.append(torch.cat([ids, new]))
        longest = max(len(row) for row in rows)
        out = input_ids.new_full((len(rows), longest), 0 if pad is None else pad)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        cache: Any = None,
        past_key_values: Any = None,
        attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The tokens the state has not read yet, and the state."""
        state = cache if isinstance(cache, TlabState) else past_key_values
        if isinstance(state, TlabState):
            input_ids = input_ids[:, state.read :]
        else:
            state = None
        inputs = {"input_ids": input_ids, "use_cache": use_cache, "cache": state}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        return inputs
