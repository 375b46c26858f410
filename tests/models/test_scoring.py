"""A model scored as lm-evaluation-harness asks (``models.scoring``): log-likelihoods equal
to the model's own next-token log-probabilities, the same in a batch as alone; each token
of a rolling document predicted once with a full context; greedy generation cut at the
first stop sequence."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from transformers_lab.attention import FastmaxAttention
from transformers_lab.models import GPT
from transformers_lab.models.scoring import (
    generate_until,
    loglikelihoods,
    rolling_loglikelihood,
    rolling_windows,
    window,
)

V, CONTEXT = 23, 12


def tiny_gpt(attention: str, **kw) -> GPT:
    torch.manual_seed(0)
    options = {"n_layer": 2, "n_head": 2, "d_model": 16, "block_size": CONTEXT} | kw
    return GPT(V, attention=attention, **options).eval()


@torch.no_grad()
def direct(model: GPT, context: list[int], continuation: list[int]) -> float:
    """The continuation's log-probability from one forward pass over the whole text."""
    full = torch.tensor([context + continuation])
    logp = model(full[:, :-1]).double().log_softmax(-1)[0]
    start = len(context) - 1
    return sum(float(logp[start + j, t]) for j, t in enumerate(continuation))


def requests(seed: int = 1) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n_context, n_continuation in [(1, 1), (5, 3), (2, 6), (7, 1), (3, 4), (6, 5)]:
        ids = torch.randint(0, V, (n_context + n_continuation,), generator=g).tolist()
        out.append((ids[:n_context], ids[n_context:]))
    return out


@pytest.mark.parametrize(
    ("attention", "options"),
    [
        ("softmax", {"pos_encoding": "rope"}),
        (functools.partial(FastmaxAttention, p=2), {}),
        ("gla", {}),
        ("softmax", {"hybrid": ["gla", "attention"]}),
    ],
    ids=["softmax-rope", "fastmax-p2", "gla", "hybrid"],
)
def test_a_continuation_scores_as_the_model_predicts_it_batched_or_alone(attention, options):
    model = tiny_gpt(attention, **options)
    asked = requests()
    alone = [loglikelihoods(model, [r], CONTEXT, batch_size=1)[0] for r in asked]
    batched = loglikelihoods(model, asked, CONTEXT, batch_size=4)
    for (context, continuation), (one, _), (many, _) in zip(asked, alone, batched, strict=True):
        assert many == pytest.approx(one, abs=1e-5)
        assert one == pytest.approx(direct(model, context, continuation), abs=1e-5)


def test_greedy_is_true_exactly_for_the_models_own_continuation():
    model = tiny_gpt("softmax")
    context = [3, 1, 4]
    greedy = []
    with torch.no_grad():
        for _ in range(4):
            logits = model(torch.tensor([context + greedy]))
            greedy.append(int(logits[0, -1].argmax()))
    other = [*greedy[:-1], (greedy[-1] + 1) % V]
    (_, mine), (_, not_mine) = loglikelihoods(model, [(context, greedy), (context, other)], CONTEXT)
    assert mine and not not_mine


def test_past_the_models_context_the_last_tokens_are_kept():
    assert window([1, 2, 3], [4, 5], 3) == [2, 3, 4]
    assert window([1], [2, 3, 4, 5, 6], 3) == [3, 4, 5]  # the continuation's last 3 scored
    with pytest.raises(ValueError, match="start token"):
        window([], [1], 3)
    model = tiny_gpt("softmax")
    long = list(range(20))
    ((value, _),) = loglikelihoods(model, [(long[:15], long[15:])], CONTEXT)
    assert value == pytest.approx(direct(model, long[15 - (CONTEXT - 4) : 15], long[15:]), abs=1e-5)


def test_rolling_windows_predict_each_token_once_with_a_full_context():
    """The harness's own example: tokens 0..9 in windows of 4 after the prefix token."""
    pairs = rolling_windows(range(10), 4, prefix=-1)
    inputs = [(c + t)[:-1] for c, t in pairs]
    assert inputs == [[-1, 0, 1, 2], [3, 4, 5, 6], [5, 6, 7, 8]]
    assert [t for _, t in pairs] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for n in range(1, 30):  # every token predicted once, every input full after the first
        pairs = rolling_windows(range(n), 4, prefix=-1)
        assert [x for _, t in pairs for x in t] == list(range(n))
        assert all(len((c + t)[:-1]) == 4 for c, t in pairs[1:])


def test_a_document_shorter_than_the_context_scores_as_one_pass():
    model = tiny_gpt("softmax")
    doc = [5, 2, 7, 7, 1, 0, 3]
    value = rolling_loglikelihood(model, doc, CONTEXT, prefix=0)
    assert value == pytest.approx(direct(model, [0], doc), abs=1e-5)
    assert math.exp(-value / len(doc)) > 1  # a perplexity


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


@torch.no_grad()
def greedy_by_recompute(model: GPT, context: list[int], n: int) -> list[int]:
    """Greedy tokens, the whole text read again at each step (no cache, no state)."""
    ids = list(context)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids[-CONTEXT:]]))[0, -1].argmax()))
    return ids[len(context) :]


@pytest.mark.parametrize("attention", ["softmax", "gla"])
def test_generation_is_greedy_on_the_models_state_and_stops_at_the_first_stop(attention):
    model = tiny_gpt(attention)
    context = [3, 1, 4, 1, 5]
    expected = letters(greedy_by_recompute(model, context, 6))
    assert generate_until(model, context, [], letters, 6) == expected
    stop = expected[3:5]
    cut = expected[: expected.find(stop)]
    assert generate_until(model, context, ["zzzz", stop], letters, 6) == cut
    assert generate_until(model, context, [expected[0]], letters, 6) == ""
    with pytest.raises(ValueError, match="start token"):
        generate_until(model, [], ["."], letters, 3)
