"""A language model scored as lm-evaluation-harness asks of it.

- ``loglikelihoods``: a continuation's log-probability given its context, and whether
  greedy decoding would give it, for many (context, continuation) pairs in batches.
- ``rolling_windows`` and ``rolling_loglikelihood``: a whole document, each token predicted
  once with as much context as the model takes (the harness's ``loglikelihood_rolling``,
  its perplexities).
- ``generate_until``: greedy decoding on the model's own state (``GPT.stream``), cut at
  the first stop sequence (the harness's ``generate_until``).

Token ids in, so any tokenizer serves; ``model`` is any callable from ids (B, T) to
next-token logits (B, T, V), as ``GPT`` is. A batch is right-padded: a causal model's
logits at a position do not depend on what follows it, so a request scores the same in a
batch as alone (the tests hold that to 1e-5). The model is scored as it is given: in
eval mode, as ``run.harness.TlabLM`` puts it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

Model = Callable[[Tensor], Tensor]
Pair = tuple[Sequence[int], Sequence[int]]


def check_context(context: Sequence[int]) -> None:
    """Refuse an empty context: a text read from its start comes after a start token."""
    if not context:
        raise ValueError(
            "a context has at least one token: give the model's start token (the harness's "
            "prefix token) before a text that starts there"
        )


def device_of(model: Any) -> torch.device:
    """Where a model's parameters are (the CPU for a callable without any)."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    return params[0].device if params else torch.device("cpu")


def window(context: Sequence[int], continuation: Sequence[int], max_length: int) -> list[int]:
    """The model's input for a pair: the last ``max_length`` tokens of context and
    continuation, less the continuation's last (a continuation longer than the model's
    context keeps its last ``max_length`` tokens scored)."""
    if not continuation:
        raise ValueError("a continuation to score has at least one token")
    check_context(context)
    return [*context, *continuation][-(max_length + 1) : -1]


@torch.no_grad()
def loglikelihoods(
    model: Model, requests: Sequence[Pair], max_length: int, batch_size: int = 16
) -> list[tuple[float, bool]]:
    """For each (context, continuation) of ``requests``: the summed log-probability of the
    continuation's tokens given what precedes them (at most ``max_length`` tokens of input),
    and whether each is the model's most likely next token. Batches of ``batch_size``,
    longest first; the answers in the requests' order."""
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
    inputs = [window(context, continuation, max_length) for context, continuation in requests]
    scored = [min(len(c), max_length) for _, c in requests]
    order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
    answers: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
    device = device_of(model)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = len(inputs[chunk[0]])
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
        logits = model(ids.to(device)).float().log_softmax(-1).cpu()
        for row, i in enumerate(chunk):
            end, n = len(inputs[i]), scored[i]
            targets = torch.tensor(list(requests[i][1])[-n:])
            rows = logits[row, end - n : end]
            logprob = rows.gather(-1, targets[:, None]).squeeze(-1).double().sum()
            answers[i] = (float(logprob), bool((rows.argmax(-1) == targets).all()))
    return answers


def rolling_windows(
    tokens: Sequence[int], max_length: int, prefix: int
) -> list[tuple[list[int], list[int]]]:
    """A document as (context, continuation) pairs that predict each of its tokens once:
    the first ``max_length`` after the ``prefix`` token, then the next ``max_length`` at a
    time with a full context of the tokens before them; the last pair predicts what is
    left, still with a full context. The harness's rolling windows (context length 1).

    Tokens 0..9, ``max_length`` 4: the inputs [p 0 1 2], [3 4 5 6], [5 6 7 8] predict
    [0 1 2 3], [4 5 6 7], [8 9]."""
    tokens = list(tokens)
    if not tokens:
        return []
    pairs = [([prefix], tokens[:max_length])]
    done = len(pairs[0][1])
    while done < len(tokens):
        count = min(len(tokens) - done, max_length)
        end = done + count
        pairs.append((tokens[end - max_length - 1 : end - count], tokens[end - count : end]))
        done = end
    return pairs


def rolling_loglikelihood(
    model: Model, tokens: Sequence[int], max_length: int, prefix: int, batch_size: int = 16
) -> float:
    """The log-likelihood of a whole document (``rolling_windows``): its perplexity is
    ``exp(-value / len(tokens))``."""
    pairs = rolling_windows(tokens, max_length, prefix)
    return sum(value for value, _ in loglikelihoods(model, pairs, max_length, batch_size))


@torch.no_grad()
def generate_until(
    model: Any,
    context: Sequence[int],
    until: Sequence[str],
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
    stop_id: int | None = None,
) -> str:
    """The greedy continuation of ``context`` (``model.stream`` at temperature 0: a KV
    cache or a recurrent state, past ``block_size`` as ``GPT.stream`` goes), as text
    (``decode``), cut before the first of the ``until`` sequences it contains, or before
    the ``stop_id`` token (the end of text, as ``generate`` stops at its end-of-sequence
    token); at most ``max_new_tokens`` tokens. An empty context is refused: give the start
    token."""
    check_context(context)
    idx = torch.tensor([list(context)], device=device_of(model))
    ids: list[int] = []
    text = ""
    for next_id in model.stream(idx, max_new_tokens, temperature=0.0):
        if int(next_id[0]) == stop_id:
            break
        ids.append(int(next_id[0]))
        text = decode(ids)
        cut = min((text.find(s) for s in until if s and s in text), default=-1)
        if cut >= 0:
            return text[:cut]
    return text
