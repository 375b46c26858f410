"""PyTorch's FlexAttention for our kernels' math: ``attention.backend=flex`` (``backends``).

FlexAttention computes ``softmax(score_mod(s q.k))`` over the pairs a block mask keeps, in
one fused kernel on CUDA (``torch.compile`` writes it once a shape). Two families fit:

- a normalised polynomial of the scores (fastmax p=1 and p=2, Based): ``f(x) / sum f`` is
  ``softmax(log f(x))``; ``1 + x + x^2/2`` is at least 1/2, ``1 + x`` is 0 at x = -1
  (opposite unit q and k) and is clamped to float32's smallest normal there;
- softmax over a window of keys (``sliding_window``): the block mask skips every block
  outside the band, so its cost grows with N W, not N^2; ALiBi is a ``score_mod``.

Keys are masked by a ``mask_mod``: causal (queries aligned to the last keys, as in the
contract), window, padding. On a CPU FlexAttention runs forward only (torch refuses its
backward there): the tests hold each path equal to our loop on the CPU, forward; the
backward waits for a GPU (tests/gpu).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

TINY = torch.finfo(torch.float32).tiny


def log_poly1(x: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """log(1 + x), clamped where 1 + x is 0 (opposite unit q and k)."""
    return torch.log(torch.clamp(1.0 + x, min=TINY))


def log_poly2(x: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """log(1 + x + x^2/2), at least log(1/2)."""
    return torch.log(1.0 + x + 0.5 * x * x)


# one function a polynomial, defined once: the compiled kernel is reused, not recompiled
LOG_POLYNOMIALS = {1: log_poly1, 2: log_poly2}


MIN_CUDA_DIM = 16  # Inductor's FlexAttention kernel takes q, k and v at least 16 wide


@functools.cache
def flex_attention(cuda: bool) -> Callable:
    """FlexAttention's function, compiled on CUDA (its fused kernel; shapes dynamic after a
    second one, so new lengths do not recompile each time), eager on a CPU."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex) if cuda else flex


def refusal(qk_dim: int, v_dim: int, device: torch.device) -> str | None:
    """Why FlexAttention cannot take heads this wide on ``device`` (None: it can)."""
    if device.type == "cuda" and min(qk_dim, v_dim) < MIN_CUDA_DIM:
        return (
            f"FlexAttention's CUDA kernel takes heads at least {MIN_CUDA_DIM} wide, got "
            f"q/k {qk_dim} and v {v_dim}"
        )
    return None


def without_grad(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors, detached where no gradient is asked for (torch refuses CPU tensors that
    require one, even under no_grad); one line where a CPU tensor needs FlexAttention's
    backward, which torch has only on CUDA."""
    wanted = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not wanted:
        return tuple(t.detach() for t in tensors)
    if tensors[0].device.type != "cuda":
        raise ValueError(
            "attention.backend=flex: FlexAttention's backward runs on CUDA only; train on a "
            "GPU (trainer=gpu) or use attention.backend=auto (our loop on a CPU)"
        )
    return tensors


def block_mask(
    nq: int,
    nk: int,
    device: torch.device,
    *,
    causal: bool,
    window: int | None = None,
    key_padding_mask: Tensor | None = None,
):
    """The block mask of the pairs a query may see (None: all), queries aligned to the last
    ``nk`` keys: causal, inside ``window``, keys not padded."""
    if not causal and window is None and key_padding_mask is None:
        return None
    if key_padding_mask is None:
        return unpadded_mask(nq, nk, str(device), causal, window)
    return make_mask(nq, nk, device, causal, window, key_padding_mask)


@functools.lru_cache(maxsize=32)
def unpadded_mask(nq: int, nk: int, device: str, causal: bool, window: int | None):
    """``block_mask`` without padding, built once a shape."""
    return make_mask(nq, nk, torch.device(device), causal, window, None)


def make_mask(
    nq: int,
    nk: int,
    device: torch.device,
    causal: bool,
    window: int | None,
    key_padding_mask: Tensor | None,
):
    from torch.nn.attention.flex_attention import create_block_mask

    off = nk - nq

    def mask_mod(b, h, i, j):
        d = i + off - j  # query i sits at key position i + off
        ok = d >= 0 if causal else d == d
        if window is not None:
            ok = ok & ((d < window) if causal else (d.abs() < window))
        if key_padding_mask is not None:
            ok = ok & ~key_padding_mask[b, j]
        return ok

    batch = None if key_padding_mask is None else key_padding_mask.shape[0]
    # compiled on CUDA: the mask is made block by block, never as an (Nq, Nk) tensor
    return create_block_mask(
        mask_mod, batch, None, nq, nk, device=device, _compile=device.type == "cuda"
    )


def flex_polynomial(
    qs: Tensor,
    ks: Tensor,
    v: Tensor,
    p: int,
    *,
    causal: bool,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """``sum_j f(qs_i . ks_j) v_j / sum_j f``, f the polynomial of order ``p`` (1 or 2), over
    the keys a query may see, by FlexAttention (the module doc). (B, H, Nq, Dv)."""
    qs, ks, v = without_grad(qs, ks, v)
    if p not in LOG_POLYNOMIALS:
        raise ValueError(f"FlexAttention covers the polynomials of order 1 and 2, got p={p}")
    score_mod = LOG_POLYNOMIALS[p]
    mask = block_mask(
        qs.shape[2], ks.shape[2], qs.device, causal=causal, key_padding_mask=key_padding_mask
    )
    flex = flex_attention(qs.device.type == "cuda")
    return flex(qs, ks, v, score_mod=score_mod, block_mask=mask, scale=1.0)


def flex_window(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    scale: float,
    *,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    slopes: Tensor | None = None,
) -> Tensor:
    """Softmax of ``scale q.k`` over the ``window`` nearest keys (the last ``window`` with
    ``causal``), minus ``slopes[h] |distance|`` where ALiBi's slopes are given, by
    FlexAttention. (B, H, Nq, Dv)."""
    q, k, v = without_grad(q, k, v)
    nq, nk = q.shape[2], k.shape[2]
    mask = block_mask(
        nq, nk, q.device, causal=causal, window=window, key_padding_mask=key_padding_mask
    )
    score_mod = None
    if slopes is not None:
        off = nk - nq

        def score_mod(x, b, h, i, j):
            return x - slopes[h] * (i + off - j).abs()

    flex = flex_attention(q.device.type == "cuda")
    return flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale)
