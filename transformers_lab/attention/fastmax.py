"""Fastmax: factorizable polynomial attention (Gerami et al., "FAST: Factorizable Attention
for Speeding up Transformers", arXiv 2402.07901, 2024).

The softmax's exponential is replaced by its Taylor polynomial of order p (1 or 2)::

    a_ij = f(x_ij) / sum_j f(x_ij),   x_ij = s * q_i . k_j,   f(x) = sum_{m<=p} x^m / m!

With u~ = [1, u], f factorises: p=1 is f = q~ . k~, and p=2 is
f(x) = (1 + x)^2 / 2 + 1/2 = sum_f w_f phi_f(q) phi_f(k), where phi(u) holds the products
u~_a u~_b of the symmetric half of u~ (x) u~: 1, u, and each pair of u once,
1 + D + D(D+1)/2 features for even D. The weights w fold in the 1/2 and the fact that
(q~ . k~)^2 counts a square once and a pair twice. So the numerator
``sum_j f(x_ij) v_j = phi(q_i) @ sum_j w * phi(k_j) v_j^T`` costs O(N * D^p * Dv), not O(N^2).

Every path works on ``v_aug = [v, 1]`` with masked keys zeroed: its last column carries
the denominator, so one product gives numerator and normaliser together. The four paths,
which agree to rounding:

- ``quadratic``: the N x N polynomial, the reference (and what ``weights`` returns);
- ``factorized``: non-causal, one state ``sum_j v_aug_j (w * phi(k_j))^T``;
- ``chunked_causal``: the exact polynomial of the C x C scores inside each chunk, and a
  running prefix state across chunks (never an N x D^p x Dv tensor);
- ``recurrent_step``: one new token, state in and state out, O(1) work per token.

States are stored value-major, (B, H, Dv + 1, F), so that the gradients w.r.t. the
features come out of the matrix products contiguous.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers_lab.attention import naive
from transformers_lab.attention.base import AttentionKernel, Memory, attention_mask

SUPPORTED_P = (1, 2)


def poly(x: Tensor, p: int) -> Tensor:
    """The Taylor polynomial of exp of order p: 1 + x (+ x^2 / 2)."""
    return 1.0 + x if p == 1 else 1.0 + x + 0.5 * x * x


def feature_dim(head_dim: int, p: int) -> int:
    """Number of features of ``feature_map``: D + 1 for p=1, (D + 1)(floor((D + 1)/2) + 1)
    for p=2 (1 + D + D(D+1)/2 when D is even)."""
    e = head_dim + 1
    return e if p == 1 else e * (e // 2 + 1)


def feature_map(u: Tensor, p: int) -> Tensor:
    """phi(u), (..., N, D) -> (..., N, F): the monomials of u~ = [1, u] of degree p.

    For p=2 they are u~_a u~_(a+r mod E) for the shifts r = 0..E/2 of E = D + 1 entries:
    every unordered pair once (for even E the last shift holds each of its pairs twice,
    and ``feature_weights`` halves them). The result is a transposed view of the
    feature-major ``features_t``.
    """
    ut_t = F.pad(u, (1, 0), value=1.0).transpose(-2, -1).contiguous()  # (..., E, N)
    return features_t(ut_t, p).transpose(-2, -1)


def _chunks_t(u: Tensor, c: int) -> Tensor:
    """u~^T of every chunk: (B, H, N, D) -> (B, H, N / C, E, C), each block contiguous.

    Whole-sequence rows N floats apart would alias in the cache when N is a power of two.
    """
    b, h, n, _ = u.shape
    ut = F.pad(u, (1, 0), value=1.0).reshape(b, h, n // c, c, -1)
    return ut.transpose(-2, -1).contiguous()


def _rolled_t(ut_t: Tensor, shifts: int) -> Tensor:
    """(..., E, N) -> (..., R, E, N) view with rolled[..., r, a, :] = ut_t[..., (a + r) % E, :]."""
    e = ut_t.shape[-2]
    doubled = torch.cat([ut_t, ut_t[..., : shifts - 1, :]], dim=-2)  # (..., E + R - 1, N)
    return doubled.unfold(-2, e, 1).transpose(-2, -1)


def features_t(ut_t: Tensor, p: int) -> Tensor:
    """Feature-major phi: u~^T (..., E, N) -> phi^T (..., F, N).

    Tokens run along the last, contiguous axis, so the products are plain vector
    multiplies of shifted rows, with no gather.
    """
    if p == 1:
        return ut_t
    e, n = ut_t.shape[-2:]
    shifts = e // 2 + 1
    rolled = _rolled_t(ut_t, shifts)
    if torch.is_grad_enabled() and ut_t.requires_grad:
        return (ut_t.unsqueeze(-3) * rolled).flatten(-3, -2)
    # Without autograd, write into a contiguous tensor: the overlapping strides of
    # ``rolled`` would otherwise give the product a scattered layout and flatten a copy.
    out = ut_t.new_empty(*ut_t.shape[:-2], shifts, e, n)
    return torch.mul(ut_t.unsqueeze(-3), rolled, out=out).flatten(-3, -2)


def features_t_vjp(ut_t: Tensor, grad_t: Tensor, p: int) -> Tensor:
    """d(sum(grad_t * features_t(ut_t, p))) / d ut_t, shape (..., E, N)."""
    if p == 1:
        return grad_t
    e, n = ut_t.shape[-2:]
    shifts = e // 2 + 1
    g = grad_t.unflatten(-2, (shifts, e))  # g[r, a] multiplies u~_a u~_((a + r) % E)
    left = (g * _rolled_t(ut_t, shifts)).sum(-3)  # the derivative through u~_a
    # through u~_((a + r) % E): d u~_b += sum_r g[r, (b - r) % E] u~_((b - r) % E)
    h = torch.cat([g * ut_t.unsqueeze(-3)] * 2, dim=-2)  # (..., R, 2E, N): h[r, j] = h[r, j % E]
    skewed = h.as_strided(  # skewed[..., r, b, :] = h[..., r, b - r + E, :]
        (*h.shape[:-3], shifts, e, n),
        (*h.stride()[:-3], (2 * e - 1) * n, n, 1),
        h.storage_offset() + e * n,
    )
    return left + skewed.sum(-3)


def feature_weights(
    head_dim: int, p: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> Tensor:
    """w with ``(w * phi(a)) . phi(b) = poly(a . b, p)``, shape (feature_dim,)."""
    e = head_dim + 1
    if p == 1:
        return torch.ones(e, dtype=dtype, device=device)
    w = torch.ones(e // 2 + 1, e, dtype=dtype, device=device)
    w[0] = 0.5  # squares u~_a^2: (1 + x)^2 / 2 holds them with weight 1/2
    w[0, 0] = 1.0  # the constant 1 * 1: 1/2 from (1 + x)^2 / 2, plus the other 1/2 of f
    if e % 2 == 0:
        w[-1] = 0.5  # the shift by E/2 meets each of its pairs twice
    return w.flatten()


def weighted_state(v_aug: Tensor, k: Tensor, p: int) -> Tensor:
    """sum over keys of v_aug (w * phi(k))^T: (..., N, Dv + 1), (..., N, D) -> (..., Dv + 1, F)."""
    w = feature_weights(k.shape[-1], p, k.dtype, k.device)
    return (v_aug.transpose(-2, -1) @ feature_map(k, p)) * w


def read_state(q: Tensor, state: Tensor, p: int) -> Tensor:
    """phi(q) @ state^T: (..., Nq, D), (..., Dv + 1, F) -> (..., Nq, Dv + 1)."""
    return feature_map(q, p) @ state.transpose(-2, -1)


def polynomial_matrix(q: Tensor, k: Tensor, p: int, allowed: Tensor | None) -> Tensor:
    """The explicit (B, H, Nq, Nk) matrix poly(q . k), zero where ``allowed`` is False."""
    a = poly(q @ k.transpose(-2, -1), p)
    return a if allowed is None else a.masked_fill(~allowed, 0.0)


def quadratic(q: Tensor, k: Tensor, v_aug: Tensor, p: int, causal: bool) -> Tensor:
    """Reference path: the explicit (B, H, Nq, Nk) polynomial times v_aug."""
    allowed = attention_mask(
        q.shape[2], k.shape[2], causal=causal, key_padding_mask=None, device=q.device
    )
    return polynomial_matrix(q, k, p, allowed) @ v_aug  # (B, H, Nq, Dv + 1)


def factorized(q: Tensor, k: Tensor, v_aug: Tensor, p: int, chunk_size: int = 128) -> Tensor:
    """Non-causal linear path: one state over every key, read by every query.

    Keys and queries are processed up to ``chunk_size`` at a time (see ``_FactorizedLoop``).
    """
    nq, nk = q.shape[2], k.shape[2]
    cq, ck = min(chunk_size, nq), min(chunk_size, nk)
    q = F.pad(q, (0, 0, 0, -nq % cq))
    k, v_aug = (F.pad(t, (0, 0, 0, -nk % ck)) for t in (k, v_aug))  # empty keys
    return _FactorizedLoop.apply(q, k, v_aug, p, cq, ck)[:, :, :nq]  # (B, H, Nq, Dv + 1)


def _first_order_only() -> None:
    """The hand-written backward passes are first-order: refuse ``create_graph``, whose
    result would silently miss the second-order terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fastmax's linear paths support first-order gradients only (create_graph=True "
            "was asked for); use attention.impl=quadratic for higher-order gradients"
        )


class _FactorizedLoop(torch.autograd.Function):
    """Non-causal state ``S = sum_j v_aug_j (w phi(k_j))^T`` and its read ``phi(q) S^T``,
    a chunk at a time with a hand-written backward pass: the features are recomputed per
    chunk, so no N x F tensor is ever held. Nq and Nk must be multiples of their chunk
    sizes cq and ck."""

    @staticmethod
    def forward(ctx, q, k, v_aug, p, cq, ck):  # type: ignore[override]
        b, h, nq, _ = q.shape
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)
        ut_q, ut_k = _chunks_t(q, cq), _chunks_t(k, ck)  # (B, H, n / C, E, C)
        state = q.new_zeros(b, h, v_aug.shape[-1], w.shape[0])  # (B, H, Dv + 1, F)
        for i in range(k.shape[2] // ck):
            vi = v_aug[:, :, i * ck : (i + 1) * ck]
            state += (vi.mT @ features_t(ut_k[:, :, i], p).mT).mul_(w)
        out = q.new_empty(b, h, nq, v_aug.shape[-1])
        for i in range(nq // cq):
            out[:, :, i * cq : (i + 1) * cq] = features_t(ut_q[:, :, i], p).mT @ state.mT
        ctx.p, ctx.cq, ctx.ck = p, cq, ck
        ctx.save_for_backward(q, k, v_aug, state)
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        _first_order_only()
        q, k, v_aug, state = ctx.saved_tensors
        p, cq, ck = ctx.p, ctx.cq, ctx.ck
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)[:, None]  # (F, 1)
        ut_q, ut_k = _chunks_t(q, cq), _chunks_t(k, ck)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v_aug)
        d_s = torch.zeros_like(state)
        for i in range(q.shape[2] // cq):
            rows = slice(i * cq, (i + 1) * cq)
            doi = d_out[:, :, rows]
            d_ut_q = features_t_vjp(ut_q[:, :, i], state.mT @ doi.mT, p)[..., 1:, :]
            dq[:, :, rows] = d_ut_q.mT
            d_s += doi.mT @ features_t(ut_q[:, :, i], p).mT
        for i in range(k.shape[2] // ck):
            rows = slice(i * ck, (i + 1) * ck)
            vi = v_aug[:, :, rows]
            dv[:, :, rows] = features_t(ut_k[:, :, i], p).mul(w).mT @ d_s.mT
            d_ut_k = features_t_vjp(ut_k[:, :, i], (d_s.mT @ vi.mT).mul_(w), p)[..., 1:, :]
            dk[:, :, rows] = d_ut_k.mT
        return dq, dk, dv, None, None, None


class _ChunkLoop(torch.autograd.Function):
    """The causal chunk recurrence with a hand-written backward pass.

    Inputs are square and whole chunks: q, k (B, H, N, D), v_aug (B, H, N, Dv + 1) with N
    a multiple of C, and the initial state (B, H, Dv + 1, F). Chunk by chunk, the output
    is the exact masked polynomial of the chunk plus phi(q) read against the state, and
    then the chunk's keys join the state. Only the inputs and the state before each chunk
    are saved: the features are recomputed in the backward pass, one chunk at a time, so
    no N x F tensor is ever held and every step works on cache-sized blocks.
    """

    @staticmethod
    def forward(ctx, q, k, v_aug, state, p, c):  # type: ignore[override]
        b, h, n, _ = q.shape
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)
        future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
        ut_q, ut_k = _chunks_t(q, c), _chunks_t(k, c)  # (B, H, nc, E, C)
        out = torch.empty_like(v_aug)
        state = state.clone()  # updated in place below
        keep = any(ctx.needs_input_grad[:4])
        before = q.new_empty(b, h, n // c, *state.shape[-2:]) if keep else None
        for i in range(n // c):
            rows = slice(i * c, (i + 1) * c)
            qi, ki, vi = q[:, :, rows], k[:, :, rows], v_aug[:, :, rows]
            if keep:
                before[:, :, i] = state
            phi_q = features_t(ut_q[:, :, i], p)  # (B, H, F, C)
            phi_k = features_t(ut_k[:, :, i], p)
            scores = poly(qi @ ki.mT, p).masked_fill_(future, 0.0)  # (B, H, C, C)
            out[:, :, rows] = scores @ vi + phi_q.mT @ state.mT
            state += (vi.mT @ phi_k.mT).mul_(w)
        ctx.p, ctx.c = p, c
        if keep:
            ctx.save_for_backward(q, k, v_aug, before)
        return out, state

    @staticmethod
    def backward(ctx, d_out, d_state):  # type: ignore[override]
        _first_order_only()
        q, k, v_aug, before = ctx.saved_tensors
        p, c = ctx.p, ctx.c
        n = q.shape[2]
        w = feature_weights(q.shape[-1], p, q.dtype, q.device)[:, None]  # (F, 1)
        future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
        ut_q, ut_k = _chunks_t(q, c), _chunks_t(k, c)  # (B, H, nc, E, C)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v_aug)
        d_s = d_state.clone()  # gradient w.r.t. the state that chunk i's keys join
        for i in reversed(range(n // c)):
            rows = slice(i * c, (i + 1) * c)
            qi, ki, vi, doi = q[:, :, rows], k[:, :, rows], v_aug[:, :, rows], d_out[:, :, rows]
            phi_q = features_t(ut_q[:, :, i], p)  # (B, H, F, C)
            phi_k = features_t(ut_k[:, :, i], p).mul(w)
            x = qi @ ki.mT
            scores = poly(x, p).masked_fill_(future, 0.0)
            # through the state: out_i = phi_q^T S^T, and later states gain v_i (w phi_k)^T
            dv[:, :, rows] = scores.mT @ doi + phi_k.mT @ d_s.mT
            d_phi_k = (d_s.mT @ vi.mT).mul_(w)  # (B, H, F, C)
            d_phi_q = before[:, :, i].mT @ doi.mT
            d_s += doi.mT @ phi_q.mT
            # through the chunk's own polynomial, poly'(x) = 1 (p=1) or 1 + x (p=2)
            dx = (doi @ vi.mT).masked_fill_(future, 0.0)
            if p == 2:
                dx.mul_(x.add_(1.0))
            d_ut_q = features_t_vjp(ut_q[:, :, i], d_phi_q, p)[..., 1:, :]  # (B, H, D, C)
            d_ut_k = features_t_vjp(ut_k[:, :, i], d_phi_k, p)[..., 1:, :]
            dq[:, :, rows] = dx @ ki + d_ut_q.mT
            dk[:, :, rows] = dx.mT @ qi + d_ut_k.mT
        return dq, dk, dv, d_s, None, None


def chunked_causal(
    q: Tensor,
    k: Tensor,
    v_aug: Tensor,
    p: int,
    chunk_size: int,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal linear path. Returns the output and the state after the last key.

    ``state`` (B, H, Dv + 1, F) is ``weighted_state`` of the keys seen before ``k``.
    Queries are aligned to the last Nq keys, as in the kernel contract.
    """
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    if state is None:
        state = q.new_zeros(b, h, v_aug.shape[-1], feature_dim(q.shape[-1], p))
    if nk > nq:  # keys before the first query are visible to every query
        split = nk - nq
        state = state + weighted_state(v_aug[:, :, :split], k[:, :, :split], p)
        k, v_aug = k[:, :, split:], v_aug[:, :, split:]
    elif nq > nk:  # queries before the first key see nothing: prepend empty keys
        k = F.pad(k, (0, 0, nq - nk, 0))
        v_aug = F.pad(v_aug, (0, 0, nq - nk, 0))
    c = min(chunk_size, nq)
    pad = -nq % c  # empty trailing keys and discarded trailing queries
    if pad:
        q, k, v_aug = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v_aug))
    out, state = _ChunkLoop.apply(q, k, v_aug, state, p, c)
    return out[:, :, :nq], state


def recurrent_step(
    q: Tensor, k: Tensor, v_aug: Tensor, p: int, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One decoding step: q, k (B, H, 1, D) and v_aug (B, H, 1, Dv + 1) of the new token.

    The state (B, H, Dv + 1, F) gains the new key, then the new query reads it.
    """
    update = weighted_state(v_aug, k, p)
    state = update if state is None else state + update
    return read_state(q, state, p), state


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den, with zeros where den is 0 (a query that saw no key)."""
    return num / den.masked_fill(den == 0, 1.0)


def normalise_output(out_aug: Tensor) -> Tensor:
    """Split [numerator, denominator] and divide; a query that saw no key gives zeros."""
    return safe_divide(out_aug[..., :-1], out_aug[..., -1:])


class FastmaxAttention(AttentionKernel):
    """Fastmax attention of Taylor order ``p``, linear in sequence length.

    Args:
        p: Taylor order, 1 or 2. ``p=2`` is positive for every score. ``p=1`` is positive
            only when ``|s q.k| <= 1``, so it requires ``normalize=True`` and ``scale <= 1``.
        scale: s, multiplies q.k before the polynomial.
        normalize: divide every query and key by its own L2 norm over the head dimension.
            The norm of each token uses that token alone, so nothing leaks from the future.
        chunk_size: C, the tokens processed at once by the linear paths.
        impl: ``"linear"`` (factorized / chunked), ``"quadratic"`` (the reference) or
            ``"auto"``: quadratic while the keys are no more than the feature dimension
            (D + 1 for p=1, about D^2 / 2 for p=2), where the N x N form is the cheaper in
            time and memory (at N=32, D=32 about 35x faster), linear beyond. Both give
            the same result; incremental decoding always uses the recurrent state.
        dropout: drops whole keys. During training each (batch, head, key) is kept with
            probability 1 - dropout and its value scaled by 1 / (1 - dropout); the
            normaliser is unchanged, so, as with dropout on an attention matrix, the
            expected output is unchanged. Dropping single (query, key) weights would need
            the N x N matrix that the linear paths never build.
        eps: guards the norm of an all-zero query or key.

    Under autocast (fp16 / bf16) the states are accumulated in float32.
    """

    name = "fastmax"
    formula = "Σ_{m≤p} (s q·k)^m / m!, normalised over keys"
    linear = True
    IMPLS = ("auto", "linear", "quadratic")

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        p: int = 2,
        scale: float = 1.0,
        normalize: bool = True,
        chunk_size: int = 128,
        impl: str = "auto",
        eps: float = 1e-6,
    ) -> None:
        super().__init__(head_dim, num_heads, dropout)
        if p not in SUPPORTED_P:
            raise ValueError(
                f"fastmax: unsupported Taylor order p={p!r}; supported orders are {SUPPORTED_P}"
            )
        if p == 1 and (not normalize or scale > 1.0):
            raise ValueError(
                "fastmax p=1 gives negative attention weights when |scale * q.k| > 1: "
                f"got normalize={normalize}, scale={scale}. Set normalize=true and scale <= 1, "
                "or use p=2, which is positive for every score."
            )
        if scale <= 0:
            raise ValueError(f"fastmax: scale must be positive, got {scale}")
        if chunk_size < 1:
            raise ValueError(f"fastmax: chunk_size must be >= 1, got {chunk_size}")
        if impl not in self.IMPLS:
            raise ValueError(f"fastmax: unknown impl {impl!r}; choose one of {self.IMPLS}")
        self.p = p
        self.scale = float(scale)
        self.normalize = normalize
        self.chunk_size = chunk_size
        self.impl = impl
        self.eps = eps

    def path(self, num_keys: int) -> str:
        """The implementation ``forward`` takes for ``num_keys`` keys."""
        if self.impl != "auto":
            return self.impl
        return "quadratic" if num_keys <= feature_dim(self.head_dim, self.p) else "linear"

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, p={self.p}, scale={self.scale}, normalize={self.normalize}, "
            f"chunk_size={self.chunk_size}, impl={self.impl}"
        )

    def prepare(
        self, q: Tensor, k: Tensor, v: Tensor | None, key_padding_mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Normalised, scaled q and k, and v_aug = [v, 1] with dropped and padded keys zeroed.

        Low-precision inputs are promoted to float32, where the states accumulate.
        """
        if q.dtype in (torch.float16, torch.bfloat16):
            q, k = q.float(), k.float()
            v = None if v is None else v.float()
        if self.normalize:
            q = F.normalize(q, dim=-1, eps=self.eps)
            k = F.normalize(k, dim=-1, eps=self.eps)
        q = q * self.scale
        pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
        if pad is not None:
            k = k.masked_fill(pad, 0.0)
        if v is None:
            return q, k, None
        if self.training and self.dropout > 0:
            keep = torch.rand(*v.shape[:3], 1, device=v.device) >= self.dropout
            v = v * keep.to(v.dtype) / (1.0 - self.dropout)
        v_aug = torch.cat([v, v.new_ones(*v.shape[:3], 1)], dim=-1)  # (B, H, Nk, Dv + 1)
        if pad is not None:
            v_aug = v_aug.masked_fill(pad, 0.0)
        return q, k, v_aug

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, v, key_padding_mask)
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, v_aug = self.prepare(q, k, v, key_padding_mask)
            if self.path(k.shape[2]) == "quadratic":
                out = quadratic(qs, ks, v_aug, self.p, causal)
            elif causal:
                out, _ = chunked_causal(qs, ks, v_aug, self.p, self.chunk_size)
            else:
                out = factorized(qs, ks, v_aug, self.p, self.chunk_size)
            return normalise_output(out).to(v.dtype)

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, _ = self.prepare(q, k, None, None)
            allowed = attention_mask(
                q.shape[2],
                k.shape[2],
                causal=causal,
                key_padding_mask=key_padding_mask,
                device=q.device,
            )
            a = polynomial_matrix(qs, ks, self.p, allowed)  # (B, H, Nq, Nk)
            return safe_divide(a, a.sum(dim=-1, keepdim=True)).to(q.dtype)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``f(x_ij) / sum_j f(x_ij)`` with ``f(x) = sum_{m<=p} x^m / m!`` and
        ``x = s q·k`` (of unit q and k when normalize), in float64."""
        if self.normalize:
            q, k = naive.unit(q), naive.unit(k)
        x = self.scale * naive.dot(q, k)
        f = sum(x**m / math.factorial(m) for m in range(self.p + 1))
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        """The recurrent state ``sum_j [v_j, 1] phi(k_j)^T``: H (Dv + 1) F, whatever n."""
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.num_heads * (value_dim + 1) * feature_dim(self.head_dim, self.p)

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Memory:
        """The factorised state of every key: reading it costs O(1) in the memory length."""
        self.check_inputs(k[:, :, :1], k, v, key_padding_mask)
        with torch.autocast(k.device.type, enabled=False):
            _, ks, v_aug = self.prepare(k[:, :, :1], k, v, key_padding_mask)
            return Memory(state=weighted_state(v_aug, ks, self.p))

    def read_memory(self, q: Tensor, memory: Memory) -> Tensor:
        if memory.state is None:
            raise ValueError("fastmax.read_memory needs a memory made by fastmax.memory()")
        with torch.autocast(q.device.type, enabled=False):
            qs, _, _ = self.prepare(q, q, None, None)
            return normalise_output(read_state(qs, memory.state, self.p)).to(q.dtype)

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Causal attention of T new tokens given the recurrent state of the past ones.

        The state is ``sum_j [v_j, 1] phi(k_j)^T`` over the keys seen so far, shape
        (B, H, Dv + 1, feature_dim): its size, and the work per new token, do not grow
        with the context.
        """
        self.check_inputs(q, k, v, key_padding_mask)
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"fastmax.decode: q and k must hold the same new tokens, got {q.shape[2]} "
                f"queries and {k.shape[2]} keys"
            )
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, v_aug = self.prepare(q, k, v, key_padding_mask)
            if q.shape[2] == 1:
                out, state = recurrent_step(qs, ks, v_aug, self.p, state)
            else:
                out, state = chunked_causal(qs, ks, v_aug, self.p, self.chunk_size, state)
            return normalise_output(out).to(v.dtype), state
