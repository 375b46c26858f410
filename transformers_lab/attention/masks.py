"""Which keys a query may see, and ALiBi's bias on the scores of those it sees.

The kernel contract (``base``) aligns a causal query to the *last* Nq keys: query ``i``
sees key ``j`` when ``j <= i + (Nk - Nq)``, as in incremental decoding; a key padding
mask is ``(B, Nk)`` bool, True at padding. ``attention_mask`` builds that rule once, for
every kernel that forms scores, and ``masked_softmax`` gives a query that sees no key an
all-zero row, never NaN. ALiBi (Press et al., 2022) adds ``-slope_h |i - j|`` to the
scores of head h, with the queries aligned the same way (``alibi_bias``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attention_mask(
    nq: int,
    nk: int,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    device: torch.device,
) -> Tensor | None:
    """Boolean mask of the (query, key) pairs that may attend, True = allowed.

    Returns ``None`` when nothing is masked, ``(Nq, Nk)`` for a causal mask alone, and
    ``(B, 1, Nq, Nk)`` when a key padding mask is given.
    """
    allowed = None
    if causal:
        i = torch.arange(nq, device=device)[:, None]
        j = torch.arange(nk, device=device)[None, :]
        allowed = j <= i + (nk - nq)  # (Nq, Nk), queries aligned to the last Nq keys
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, Nk)
        allowed = keep if allowed is None else allowed & keep
    return allowed


def visible_keys(
    allowed: Tensor | None, nq: int, nk: int, device: torch.device | None = None
) -> Tensor:
    """How many keys each query may see, shaped to divide a (·, ·, Nq, Nk) tensor: all
    Nk when nothing is masked."""
    if allowed is None:
        return torch.full((nq, 1), nk, device=device)
    return allowed.sum(dim=-1, keepdim=True)


def masked_softmax(scores: Tensor, allowed: Tensor | None) -> Tensor:
    """Softmax over the last dim that gives masked entries (and fully masked rows) zero."""
    if allowed is None:
        return scores.softmax(dim=-1)
    # A finite fill keeps fully masked rows finite (uniform) before they are zeroed below.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1).masked_fill(~allowed, 0.0)


def alibi_slopes(n_head: int) -> list[float]:
    """The head slopes of ALiBi (Press et al., 2022): the geometric sequence that starts
    at 2^(-8/n) with that ratio, for n heads; for n not a power of two, those of the
    largest power of two below n, then every other slope of twice that many heads."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if n_head & (n_head - 1) == 0:
        return geometric(n_head)
    m = 2 ** math.floor(math.log2(n_head))
    return geometric(m) + geometric(2 * m)[0::2][: n_head - m]


def alibi_bias(slopes: Tensor, nq: int, nk: int) -> Tensor:
    """(H, Nq, Nk): -slope_h |i + (Nk - Nq) - j|, the distance of key j from query i with
    the queries aligned to the last Nq keys (a causal mask keeps j <= i; an encoder sees
    both sides at the same cost)."""
    i = torch.arange(nq, device=slopes.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=slopes.device)[None, :]
    return -slopes[:, None, None] * (i - j).abs().to(slopes.dtype)
