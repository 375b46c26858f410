"""The feature maps of the linear paths: phi(u) = the monomials of [1, u] up to degree p
(fastmax's Taylor polynomial for p = 1, 2), or, for p = 0, u itself: features that a
kernel computed (elu + 1, random features, a learned projection), scored by their plain
dot product. In the feature-major layout the linear paths use, with its vector-Jacobian
product, the weights that turn phi(q) . phi(k) into the polynomial, and the state of a
set of keys. p = 0 is how every linear kernel shares the feature-map engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED_P = (1, 2)  # fastmax's orders; 0 is the engine's "features given"


def poly(x: Tensor, p: int) -> Tensor:
    """The Taylor polynomial of exp of order p: 1 + x (+ x^2 / 2); x itself for p=0."""
    if p == 0:
        return x
    return 1.0 + x if p == 1 else 1.0 + x + 0.5 * x * x


def constant(p: int) -> int:
    """How many leading entries of u~ are the constant 1: none for p=0, else one."""
    return 0 if p == 0 else 1


def feature_dim(head_dim: int, p: int) -> int:
    """Number of features of ``feature_map``: D for p=0, D + 1 for p=1,
    (D + 1)(floor((D + 1)/2) + 1) for p=2 (1 + D + D(D+1)/2 when D is even)."""
    e = head_dim + constant(p)
    return e if p < 2 else e * (e // 2 + 1)


def feature_map(u: Tensor, p: int) -> Tensor:
    """phi(u), (..., N, D) -> (..., N, F): the monomials of u~ = [1, u] of degree p.

    For p=2 they are u~_a u~_(a+r mod E) for the shifts r = 0..E/2 of E = D + 1 entries:
    every unordered pair once (for even E the last shift holds each of its pairs twice,
    and ``feature_weights`` halves them). The result is a transposed view of the
    feature-major ``features_t``.
    """
    ut_t = F.pad(u, (constant(p), 0), value=1.0).transpose(-2, -1).contiguous()  # (..., E, N)
    return features_t(ut_t, p).transpose(-2, -1)


def chunks_t(u: Tensor, c: int, p: int) -> Tensor:
    """``doubled_t`` of every chunk, chunk-major: (B, H, N, D) -> (N / C, B, H, E + E // 2,
    C) for p=2, (N / C, B, H, E, C) otherwise, each block contiguous (u~ = [1, u], or u
    for p=0).

    Whole-sequence rows N floats apart would alias in the cache when N is a power of two;
    and a chunk's strides do not depend on N (a compiled step compiles once for every N).
    """
    return blocks_t(chunk_view(u.detach(), c), p)


def blocks_t(uc: Tensor, p: int) -> Tensor:
    """``chunks_t`` from the chunk-major blocks ``uc`` (N / C, B, H, C, D) of u (a view of
    them, transposed, for p=0 when ``uc`` is contiguous)."""
    if p == 0 and uc.is_contiguous():
        return uc.mT
    ut_t = F.pad(uc, (constant(p), 0), value=1.0).mT
    return doubled_t(ut_t, p) if p == 2 else dense(ut_t)  # (cat makes a new tensor)


def chunk_major(x: Tensor, c: int) -> Tensor:
    """(B, H, N, X) -> (N / C, B, H, C, X), contiguous: chunk i is ``x[:, :, iC:(i+1)C]``
    as a block whose strides do not depend on N. Detached: blocks are the steps' inputs
    inside a hand-written backward pass (and one chunk's block, a view of x, would
    otherwise carry x's requires_grad into a compiled step's guards)."""
    return dense(chunk_view(x.detach(), c))


def chunk_view(x: Tensor, c: int) -> Tensor:
    """(B, H, N, X) -> (N / C, B, H, C, X) as a view of x, no copy: chunk i of x to
    write a step's output or gradient into, in place."""
    b, h, n, d = x.shape
    return x.view(b, h, n // c, c, d).permute(2, 0, 1, 3, 4)


def dense(x: Tensor) -> Tensor:
    """A contiguous copy of x with the strides of a new tensor, also where a dimension
    has size 1 (``contiguous`` keeps a view's stride there: a compiled step's guards
    would see a new stride whenever N fits in one chunk)."""
    return x.new_empty(x.shape).copy_(x)


def doubled_t(ut_t: Tensor, p: int) -> Tensor:
    """For p=2, u~^T with its first E // 2 rows repeated below it, (..., E, N) ->
    (..., E + E // 2, N): every shift of ``features_t`` is then a window of it
    (``windows``), with no copy. For p < 2, u~^T as it is."""
    if p < 2:
        return ut_t
    return torch.cat([ut_t, ut_t[..., : ut_t.shape[-2] // 2, :]], dim=-2)


def windows(d: Tensor, e: int) -> Tensor:
    """(..., E + R - 1, N) -> (..., R, E, N) view: windows[..., r, a, :] = d[..., a + r, :]."""
    return d.unfold(-2, e, 1).transpose(-2, -1)


def features_t(ut_t: Tensor, p: int) -> Tensor:
    """Feature-major phi: u~^T (..., E, N) -> phi^T (..., F, N).

    Tokens run along the last, contiguous axis, so the products are plain vector
    multiplies of shifted rows, with no gather.
    """
    return features_d(doubled_t(ut_t, p), ut_t.shape[-2], p)


def features_d(d: Tensor, e: int, p: int) -> Tensor:
    """``features_t`` of the ``doubled_t`` layout ``d`` of E rows."""
    if p < 2:
        return d
    ut_t, rolled = d[..., :e, :], windows(d, e)
    if (torch.is_grad_enabled() and d.requires_grad) or torch.compiler.is_compiling():
        return (ut_t.unsqueeze(-3) * rolled).flatten(-3, -2)
    # Without autograd, write into a contiguous tensor: the overlapping strides of
    # ``rolled`` would otherwise give the product a scattered layout and flatten a copy.
    out = d.new_empty(*d.shape[:-2], rolled.shape[-3], e, d.shape[-1])
    return torch.mul(ut_t.unsqueeze(-3), rolled, out=out).flatten(-3, -2)


def features_t_vjp(ut_t: Tensor, grad_t: Tensor, p: int) -> Tensor:
    """d(sum(grad_t * features_t(ut_t, p))) / d ut_t, shape (..., E, N)."""
    return features_d_vjp(doubled_t(ut_t, p), ut_t.shape[-2], grad_t, p)


def features_d_vjp(d: Tensor, e: int, grad_t: Tensor, p: int) -> Tensor:
    """``features_t_vjp`` of the ``doubled_t`` layout ``d`` of E rows."""
    if p < 2:
        return grad_t
    shifts = e // 2 + 1
    g = grad_t.unflatten(-2, (shifts, e))  # g[r, a] multiplies u~_a u~_((a + r) % E)
    out = (g * windows(d, e)).sum(-3)  # the derivative through u~_a
    if torch.compiler.is_compiling():  # the same sum as rolls, which Inductor fuses
        m = g * d[..., :e, :].unsqueeze(-3)  # reaches u~_b, b = (a + r) % E: a roll by r
        for r in range(shifts):
            out = out + torch.roll(m[..., r, :, :], r, dims=-2)
        return out
    # through u~_b, b = (a + r) % E: m[r, a] = g[r, a] u~_a reaches u~_b from row (b - r) % E.
    # With the last R - 1 rows of each shift put in front of it (md), that row is
    # md[r, b - r + R - 1]: a skewed view, summed over r.
    m = g * d[..., :e, :].unsqueeze(-3)  # (..., R, E, N)
    md = torch.cat([m[..., e - shifts + 1 :, :], m], dim=-2)  # (..., R, E + R - 1, N)
    n, rows = md.shape[-1], md.shape[-2]
    skewed = md.as_strided(
        (*md.shape[:-3], shifts, e, n),
        (*md.stride()[:-3], (rows - 1) * n, n, 1),
        md.storage_offset() + (shifts - 1) * n,
    )
    return out.add_(skewed.sum(-3))


def feature_weights(
    head_dim: int, p: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> Tensor:
    """w with ``(w * phi(a)) . phi(b) = poly(a . b, p)``, shape (feature_dim,)."""
    e = head_dim + constant(p)
    if p < 2:
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


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den, with zeros where den is 0 (a query that saw no key)."""
    return num / den.masked_fill(den == 0, 1.0)


def first_order_only() -> None:
    """The hand-written backward passes are first-order: refuse ``create_graph``, whose
    result would silently miss the second-order terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "fastmax's linear paths support first-order gradients only (create_graph=True "
            "was asked for); use attention.impl=quadratic for higher-order gradients"
        )
