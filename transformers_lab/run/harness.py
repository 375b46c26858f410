"""A checkpoint scored by lm-evaluation-harness (0.4), as the field scores language models:
``TlabLM`` is the harness's model over ours, scoring with ``models.scoring``:

- ``loglikelihood``: each (context, continuation) in batches, with whether greedy decoding
  gives the continuation;
- ``loglikelihood_rolling``: a whole document in windows of the model's context, each token
  predicted once (the harness's perplexities);
- ``generate_until``: greedy decoding on the model's own state (a KV cache or a recurrent
  state, past ``block_size`` where the model goes on), cut at the first stop sequence.

Text is split as the harness's own models split it: a context's trailing spaces go to the
continuation, and the continuation's tokens are those the whole text adds to the
context's. A text that starts with nothing before it is read after the ``prefix`` token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lm_eval.api.model import LM

from transformers_lab.models.scoring import (
    generate_until,
    loglikelihoods,
    rolling_loglikelihood,
)

DEFAULT_GENERATED = 256  # the harness's max_gen_toks when a task gives none


class TlabLM(LM):
    """The harness's model over one of ours: ``model`` (ids (B, T) -> logits (B, T, V),
    with ``stream`` for generation), its tokenizer (``encode``, ``decode``), the context it
    reads (``max_length``: its ``block_size``) and the token read before a text that has
    no context (``prefix``)."""

    def __init__(
        self,
        model: Any,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        max_length: int,
        prefix: int,
        batch_size: int = 16,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.encode, self.decode = encode, decode
        self.max_length, self.prefix, self.batch_size = max_length, prefix, batch_size

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """A request's (context, continuation) ids, as the harness's models split them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix], self.encode(continuation)
        whole, before = self.encode(context + continuation), self.encode(context)
        return before, whole[len(before) :]

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        pairs = [self.pair(*request.args) for request in requests]
        return loglikelihoods(self.model, pairs, self.max_length, self.batch_size)

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        return [
            rolling_loglikelihood(
                self.model,
                self.encode(request.args[0]),
                self.max_length,
                self.prefix,
                self.batch_size,
            )  # fmt: skip
            for request in requests
        ]

    def generate_until(self, requests: list[Any]) -> list[str]:
        out = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            count = int(options.get("max_gen_toks") or DEFAULT_GENERATED)
            ids = self.encode(context) or [self.prefix]
            out.append(generate_until(self.model, ids, until, self.decode, count))
        return out
