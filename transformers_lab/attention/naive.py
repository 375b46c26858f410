"""Naive float64 building blocks of the kernels' references (``reference_weights``).

Written for reading, not speed: the mask is built pair by pair, and the rows are
normalised by their explicit sums. Every kernel's reference composes these with its own
score or feature formula, so that the fast paths are checked against arithmetic that
shares none of their code.
"""

from __future__ import annotations

import torch
from torch import Tensor


def allowed_pairs(
    batch: int, nq: int, nk: int, *, causal: bool, key_padding_mask: Tensor | None
) -> Tensor:
    """(B, 1, Nq, Nk) bool, True where query i may see key j: j <= i + (Nk - Nq) when
    causal (queries aligned to the last Nq keys), and key j not padding."""
    allowed = torch.ones(batch, 1, nq, nk, dtype=torch.bool)
    for b in range(batch):
        for i in range(nq):
            for j in range(nk):
                if causal and j > i + (nk - nq):
                    allowed[b, 0, i, j] = False
                if key_padding_mask is not None and bool(key_padding_mask[b, j]):
                    allowed[b, 0, i, j] = False
    return allowed


def pair_mask(q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    return allowed_pairs(
        q.shape[0], q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask
    ).to(q.device)


def normalise_rows(f: Tensor, allowed: Tensor) -> Tensor:
    """f with the masked pairs zeroed, each row divided by its sum (an all-zero row
    stays zero)."""
    f = torch.where(allowed, f, torch.zeros_like(f))
    total = f.sum(dim=-1, keepdim=True)
    return torch.where(total != 0, f / torch.where(total != 0, total, 1.0), torch.zeros_like(f))


def softmax_rows(scores: Tensor, allowed: Tensor) -> Tensor:
    """exp(score) over the allowed keys of each row, normalised (shifted by the row's
    largest allowed score, which changes nothing but the rounding)."""
    top = torch.where(allowed, scores, torch.full_like(scores, -torch.inf)).amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return normalise_rows(torch.exp(scores - top), allowed)


def dot(q: Tensor, k: Tensor) -> Tensor:
    """q_i . k_j for every pair, in float64: (B, H, Nq, Nk)."""
    return torch.einsum("bhid,bhjd->bhij", q.double(), k.double())


def unit(x: Tensor) -> Tensor:
    """Each vector divided by its L2 norm (float64)."""
    x = x.double()
    return x / x.norm(dim=-1, keepdim=True)
