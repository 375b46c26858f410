"""Incremental decoding: one new token against the recurrent state, O(1) work per
token whatever the context length."""

from __future__ import annotations

from torch import Tensor

from transformers_lab.attention.feature_map.features import read_state, weighted_state


def recurrent_step(
    q: Tensor, k: Tensor, v_aug: Tensor, p: int, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One decoding step: q, k (B, H, 1, D) and v_aug (B, H, 1, Dv + 1) of the new token.

    The state (B, H, Dv + 1, F) gains the new key, then the new query reads it.
    """
    update = weighted_state(v_aug, k, p)
    state = update if state is None else state + update
    return read_state(q, state, p), state
