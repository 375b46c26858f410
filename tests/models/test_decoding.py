"""Decoding past block_size (GPT.stream): on the decoding state where the positions go
on, each step the same cost; cropped to the window, said once, where they end."""

from __future__ import annotations

import functools

import pytest
import torch

from transformers_lab.attention.sliding_window import SlidingWindowAttention
from transformers_lab.models import GPT

V, WINDOW = 23, 8
OPTIONS = {"n_layer": 2, "n_head": 2, "d_model": 16}


def gpt(block_size: int, **kw) -> GPT:
    return GPT(V, block_size, **(OPTIONS | kw)).double().eval()


def greedy_by_full_forward(model: GPT, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """The greedy continuation recomputed from the whole sequence at every step."""
    idx = prompt
    for _ in range(steps):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


CONSTANT = [
    ("fastmax", "none"),
    ("fastmax", "rope"),
    ("linear", "rope"),
    ("gla", "none"),
    ("gated_deltanet", "rope"),
]


@pytest.mark.parametrize(("attention", "positions"), CONSTANT)
def test_a_constant_state_generates_past_block_size_as_the_full_forward(attention, positions):
    """Trained at 8 tokens, it reads a 12-token prompt whole and writes 30 more on its
    state: the same tokens as the full forward over the whole sequence (a twin with a
    longer context and the same weights: without a positions table none depend on it)."""
    torch.manual_seed(0)
    model = gpt(WINDOW, attention=attention, pos_encoding=positions)
    assert model.decode_limit() is None and not model.states_grow()
    twin = gpt(64, attention=attention, pos_encoding=positions)
    twin.load_state_dict(model.state_dict())
    prompt = torch.randint(0, V, (2, 12))
    out = model.generate(prompt, 30, temperature=0)
    assert out.shape == (2, 42)
    assert torch.equal(out, greedy_by_full_forward(twin, prompt, 30))
    logits, _ = model.forward_on_state(out)
    torch.testing.assert_close(logits, twin(out), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("positions", ["rope", "alibi", "none"])
def test_a_kv_cache_slides_a_window_of_block_size(positions):
    """Softmax past block_size keeps its last block_size - 1 keys: each token sees
    block_size tokens at every layer, exactly the sliding-window kernel of that width run
    over the whole sequence (RoPE's keys keep their rotations, ALiBi its distances)."""
    torch.manual_seed(1)
    model = gpt(WINDOW, attention="softmax", pos_encoding=positions)
    assert model.decode_limit() is None and model.states_grow()
    window = functools.partial(SlidingWindowAttention, window=WINDOW)
    twin = gpt(64, attention=window, pos_encoding=positions)
    twin.load_state_dict(model.state_dict())
    prompt = torch.randint(0, V, (2, 11))
    out = model.generate(prompt, 25, temperature=0)
    assert torch.equal(out, greedy_by_full_forward(twin, prompt, 25))
    # the logits too, read on the state (a window of block_size + 1 would differ here)
    logits, _ = model.forward_on_state(out)
    torch.testing.assert_close(logits, twin(out), rtol=1e-9, atol=1e-9)
    # and the cache holds no more than the window
    logits, cache = model.forward_cached(prompt[:, :WINDOW])
    kept = model.slide(cache, WINDOW - 1)
    assert [state.kernel[0].shape[2] for state in kept] == [WINDOW - 1] * 2
    assert [state.seen for state in kept] == [WINDOW] * 2  # positions go on counting


def test_a_hybrid_slides_its_softmax_layers_and_carries_its_recurrent_ones():
    torch.manual_seed(2)
    model = gpt(WINDOW, attention="gla", pos_encoding="rope", hybrid={1: "softmax"})
    assert model.decode_limit() is None and model.states_grow()
    prompt = torch.randint(0, V, (1, 5))
    out = model.generate(prompt, 20, temperature=0)
    logits, cache = model.forward_cached(out[:, :12])
    kept = model.slide(cache, WINDOW - 1)
    assert kept[0].kernel is cache[0].kernel  # gla: its constant state as it is
    assert kept[1].kernel[0].shape[2] == WINDOW - 1  # softmax: the window


def test_table_positions_crop_to_the_window():
    """Learned positions end at block_size: past it the last block_size tokens are
    re-encoded, as without the cache (tlab-sample says so, test_sample.py)."""
    torch.manual_seed(3)
    model = gpt(WINDOW, attention="fastmax", pos_encoding="learned")
    assert model.decode_limit() == "its learned positions end at block_size=8"
    prompt = torch.randint(0, V, (2, 3))
    cached = model.generate(prompt, 20, temperature=0)
    assert torch.equal(cached, model.generate(prompt, 20, temperature=0, use_cache=False))
    cosformer = gpt(WINDOW, attention="cosformer", pos_encoding="none")
    assert "cosformer weighs positions up to its max_len" in cosformer.decode_limit()


@pytest.mark.parametrize(
    ("options", "reaches", "said"),
    [
        ({"pos_encoding": "learned"}, 16, "its learned positions end at block_size=16"),
        ({"pos_encoding": "rope"}, 10**6, None),
        ({"pos_encoding": "alibi"}, 10**6, None),
        ({"pos_encoding": "sinusoidal"}, 10**6, None),  # a formula: rebuilt at any length
        ({"pos_encoding": "none", "attention": "cosformer"}, 1024, "max_len=1024"),
    ],
)
def test_reach_names_what_ends_a_model_s_context(options, reaches, said):
    """GPT.reach: the longest input these weights read, the model rebuilt longer."""
    model = gpt(16, **options)
    assert model.reach(reaches) is None
    if said is not None:
        assert said in model.reach(reaches + 1)
