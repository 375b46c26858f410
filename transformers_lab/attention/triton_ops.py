"""Our own fused kernel: fastmax of order 2 in linear time, ``attention.backend=triton``.

No library has one at a head width of 64 (fla's ``fused_chunk_based`` takes features at
most 16 wide; its ``parallel_based`` is quadratic in time; a Taylor feature map with
``chunk_linear_attn`` writes 1 + D + D(D+1)/2 features a token to memory).
``_fastmax_triton`` holds the Triton kernels and their design; this file launches them,
gives them autograd, and moves their state to and from the engine's layout, so that a
prefill through them and decoding on our recurrence share it.

It runs on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), where
tests/attention/test_triton_fastmax.py holds it equal to our chunk loop in float32:
outputs, gradients and the final state. Its float32 products run in TF32 on a GPU, as
fla's do; training in bf16 (``trainer=gpu``) runs them in bf16 with float32 states.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import Tensor

from transformers_lab.attention.backends import check_device, interpreted
from transformers_lab.attention.feature_map.features import (
    feature_dim,
    feature_weights,
    safe_divide,
)

HEAD_WIDTHS = (16, 32, 64, 128)  # q, k and v widths the kernels take (powers of two, >= 16)
CHUNK = 64  # tokens a chunk on a GPU in 16 bits, half that in float32; the tests take 16
# f(x) = c0 + c1 x + c2 x^2: fastmax p=2's weights, and its normaliser's (the kernel takes
# them apart, so a test can break either and see the comparison fail)
WEIGHTS = (1.0, 1.0, 0.5)
NORMALISER = (1.0, 1.0, 0.5)
PARTS = ("S0", "S1", "S2", "Z0", "Z1", "Z2")  # the kernels' state: ``_fastmax_triton``


def refusal(head_dim: int, value_dim: int | None = None) -> str | None:
    """Why the fused kernel cannot take heads ``head_dim`` wide (None: it can)."""
    widths = ", ".join(map(str, HEAD_WIDTHS))
    if head_dim not in HEAD_WIDTHS:
        return f"the fused fastmax kernel takes head widths {widths}, got {head_dim}"
    if value_dim is not None and value_dim not in HEAD_WIDTHS:
        return f"the fused fastmax kernel takes value widths {widths}, got {value_dim}"
    return None


def kernels():
    """The Triton kernels (imported on first use: Triton reads TRITON_INTERPRET then)."""
    return importlib.import_module("transformers_lab.attention._fastmax_triton")


def tiles(d: int, dv: int) -> tuple[int, int]:
    """(BA, BV): the rows and columns of S2 in a block (a program keeps a pair of blocks, BA
    x BA features) and the value columns a program keeps."""
    return min(16, d // 2), min(dv, 32)


def pairs(d: int, device: torch.device) -> Tensor:
    """The pairs of blocks A <= B of S2's rows and columns, (0, 0) first: int32 (pairs, 2)."""
    blocks = d // tiles(d, d)[0]
    found = [(a, b) for a in range(blocks) for b in range(a, blocks)]
    return torch.tensor(found, dtype=torch.int32, device=device)


def chunk_for(dtype: torch.dtype) -> int:
    """Tokens a chunk: ``CHUNK`` in 16 bits, half in float32, whose tiles take twice the
    shared memory (the kernel's first form, tiles of whole rows of S2, needed 273 KiB of an
    H100's 228 a block at D=128 in float32 with chunks of 64)."""
    return CHUNK if dtype in (torch.bfloat16, torch.float16) else max(16, CHUNK // 2)


def compile_kernels(
    arch: int = 90,
    widths: tuple[int, ...] = HEAD_WIDTHS,
    dtypes: tuple[str, ...] = ("bf16", "fp32"),
) -> list[dict]:
    """Compile every kernel for CUDA compute capability ``arch`` (90: H100 and H200) at each
    head width and dtype, ahead of time and without a GPU (Triton's compiler and ptxas
    alone): what a GPU would compile first, checked on any machine. One dict a kernel,
    width and dtype: its shared memory in bytes. Not under Triton's interpreter (which
    compiles nothing)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreted():
        raise RuntimeError("compile_kernels compiles for a GPU: unset TRITON_INTERPRET")
    ops, found = kernels(), []
    for name in ("_fwd", "_dq", "_dkdv"):
        fn = getattr(ops, name)
        params = [p.name for p in fn.params]
        for d in widths:
            ba, bv = tiles(d, d)
            flags = {"HAS_MASK": True, "STATE_IN": True, "STATE_OUT": True}
            for dtype in dtypes:
                chunk = chunk_for(torch.float32 if dtype == "fp32" else torch.bfloat16)
                const = {"D": d, "DV": d, "C": chunk, "BA": ba, "BV": bv, **flags}
                signature, constexprs = {}, {}
                for i, p in enumerate(params):
                    if p in const:
                        signature[p], constexprs[(i,)] = "constexpr", const[p]
                    elif p == "N":
                        signature[p] = "i32"
                    elif len(p) == 2 and p[0] in "cd" and p[1].isdigit():
                        signature[p] = "fp32"  # the weights' and the normaliser's coefficients
                    else:
                        signature[p] = (
                            f"*{dtype}" if p in ("Q", "K", "V", "G")
                            else "*i32" if p == "PAIRS" else "*fp32"
                        )  # fmt: skip
                source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
                done = triton.compile(source, target=GPUTarget("cuda", arch, 32))
                found.append(
                    {"kernel": name, "D": d, "dtype": dtype, "shared": done.metadata.shared}
                )
    return found


# ------------------------------------------------------------------ state layouts


def pair_index(e: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """For each engine feature (shift r, row a), its pair (a, (a + r) % E) of u~ = [1, u]."""
    shifts = e // 2 + 1
    a = torch.arange(e, device=device).repeat(shifts)
    r = torch.arange(shifts, device=device).repeat_interleave(e)
    return a, (a + r) % e


def to_engine(parts: dict[str, Tensor], b: int, h: int) -> Tensor:
    """The kernels' state (S0, S1, S2 and the normaliser's Z0, Z1, Z2) as the engine's
    ``weighted_state``, (B, H, Dv + 1, F)."""
    s1 = parts["S1"]
    bh, d, dv = s1.shape
    e = d + 1
    m = s1.new_zeros(bh, dv + 1, e, e)
    m[:, :dv, 0, 0], m[:, dv, 0, 0] = parts["S0"], parts["Z0"]
    m[:, :dv, 0, 1:] = m[:, :dv, 1:, 0] = s1.mT
    m[:, dv, 0, 1:] = m[:, dv, 1:, 0] = parts["Z1"]
    blk = torch.arange(d, device=s1.device) // tiles(d, d)[0]
    lower = blk[:, None] > blk[None, :]  # blocks the kernel leaves to their mirror (B, A)
    s2 = torch.where(lower[..., None], parts["S2"].transpose(1, 2), parts["S2"])
    m[:, :dv, 1:, 1:] = s2.permute(0, 3, 1, 2)
    m[:, dv, 1:, 1:] = torch.where(lower, parts["Z2"].mT, parts["Z2"])
    a, c = pair_index(e, s1.device)
    w = feature_weights(d, 2, s1.dtype, s1.device)
    return (m[:, :, a, c] * w).view(b, h, dv + 1, -1)


def from_engine(state: Tensor) -> dict[str, Tensor]:
    """``to_engine`` undone: the engine's state (B, H, Dv + 1, F) as the kernels' parts,
    float32, contiguous."""
    b, h, dv1, f = state.shape
    d = round((math.sqrt(8 * f + 1) - 3) / 2)  # F = (D + 1)(D + 2) / 2 for even D
    if feature_dim(d, 2) != f:
        raise ValueError(f"a fastmax p=2 state has (D + 1)(D + 2) / 2 features, got {f}")
    e, dv = d + 1, dv1 - 1
    a, c = pair_index(e, state.device)
    pairs = state.reshape(b * h, dv1, f).float() / feature_weights(d, 2, device=state.device)
    m = pairs.new_zeros(b * h, dv1, e, e)
    m[:, :, a, c] = pairs
    m[:, :, c, a] = pairs
    return {
        "S0": m[:, :dv, 0, 0].contiguous(),
        "S1": m[:, :dv, 0, 1:].mT.contiguous(),
        "S2": m[:, :dv, 1:, 1:].permute(0, 2, 3, 1).contiguous(),
        "Z0": m[:, dv, 0, 0].contiguous(),
        "Z1": m[:, dv, 0, 1:].contiguous(),
        "Z2": m[:, dv, 1:, 1:].contiguous(),
    }


def empty_parts(bh: int, d: int, dv: int, device: torch.device) -> dict[str, Tensor]:
    shapes = {"S0": (dv,), "S1": (d, dv), "S2": (d, d, dv), "Z0": (), "Z1": (d,), "Z2": (d, d)}
    return {key: torch.zeros(bh, *shape, device=device) for key, shape in shapes.items()}


# ------------------------------------------------------------------ the op


class _TritonFastmax(torch.autograd.Function):
    """Causal fastmax p=2 by the fused kernels: (B, H, N, D) q and k (features: normalised,
    queries scaled), v (B, H, N, Dv), m (B, H, N) the keys' weights or None, the state
    before the first key (kernel parts) or None. Returns the output and the state after
    the last key (the parts, in ``PARTS``' order, not differentiated; placeholders unless
    ``want_state``)."""

    @staticmethod
    def forward(ctx, q, k, v, m, parts, want_state, chunk):  # type: ignore[override]
        b, h, n, d = q.shape
        dv = v.shape[-1]
        bh = b * h
        q3, k3, v3 = (t.reshape(bh, n, t.shape[-1]).contiguous() for t in (q, k, v))
        m2 = None if m is None else m.reshape(bh, n).float().contiguous()
        o = torch.zeros(bh, n, dv, device=q.device)
        z = torch.zeros(bh, n, device=q.device)
        keep_state = parts is not None or want_state
        if parts is not None:  # read, then written over, by the kernel: a copy of its own
            out_parts = {key: t.clone() for key, t in parts.items()}
        elif want_state:
            out_parts = empty_parts(bh, d, dv, q.device)
        else:  # placeholders the kernel never touches
            out_parts = dict.fromkeys(PARTS, o.new_zeros(1))
        ba, bv = tiles(d, dv)
        blocks = pairs(d, q.device)
        grid = (dv // bv, len(blocks), bh)
        kernels()._fwd[grid](
            q3, k3, v3, o if m2 is None else m2, o, z, blocks,
            *(out_parts[key] for key in PARTS),
            n, *WEIGHTS, *NORMALISER,
            D=d, DV=dv, C=chunk, BA=ba, BV=bv, HAS_MASK=m2 is not None,
            STATE_IN=parts is not None, STATE_OUT=keep_state,
        )  # fmt: skip
        y = safe_divide(o, z[..., None])
        ctx.save_for_backward(q3, k3, v3, m2, y, z)
        ctx.shape, ctx.chunk, ctx.parts = (b, h, n, d, dv), chunk, parts
        kept = tuple(out_parts[key] for key in PARTS)
        ctx.mark_non_differentiable(*kept)
        return y.view(b, h, n, dv).to(v.dtype), *kept

    @staticmethod
    def backward(ctx, dy, *_d_state):  # type: ignore[override]
        q3, k3, v3, m2, y, z = ctx.saved_tensors
        b, h, n, d, dv = ctx.shape
        bh = b * h
        dy = dy.reshape(bh, n, dv).float()
        g = safe_divide(dy, z[..., None])  # the numerator's gradient
        hn = -safe_divide((dy * y).sum(-1), z)  # the normaliser's
        g = g.to(q3.dtype).contiguous()
        dq = torch.zeros(bh, n, d, device=q3.device)
        dk, dval = torch.zeros_like(dq), torch.zeros(bh, n, dv, device=q3.device)
        ba, bv = tiles(d, dv)
        blocks = pairs(d, q3.device)
        grid = (dv // bv, len(blocks), bh)
        ops = kernels()
        parts = ctx.parts or {}
        ops._dq[grid](
            q3, k3, v3, dq if m2 is None else m2, g, hn, dq, blocks,
            *(parts.get(key, dq) for key in ("S1", "S2", "Z1", "Z2")),
            n, *WEIGHTS[1:], *NORMALISER[1:],
            D=d, DV=dv, C=ctx.chunk, BA=ba, BV=bv, HAS_MASK=m2 is not None,
            STATE_IN=ctx.parts is not None,
        )  # fmt: skip
        ops._dkdv[grid](
            q3, k3, v3, dq if m2 is None else m2, g, hn, dk, dval, blocks,
            n, *WEIGHTS, *NORMALISER[1:],
            D=d, DV=dv, C=ctx.chunk, BA=ba, BV=bv, HAS_MASK=m2 is not None,
        )  # fmt: skip
        shape = (b, h, n)
        return (
            dq.view(*shape, d).to(q3.dtype),
            dk.view(*shape, d).to(k3.dtype),
            dval.view(*shape, dv).to(v3.dtype),
            None,
            None,
            None,
            None,
        )


def triton_fastmax(
    qs: Tensor,
    ks: Tensor,
    v: Tensor,
    keep: Tensor | None = None,
    state: Tensor | None = None,
    *,
    want_state: bool = False,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Causal ``sum_j f(qs_i . ks_j) v_j / sum_j f(qs_i . ks_j)``, j <= i (and every key
    of ``state``), f(x) = 1 + x + x^2 / 2, by the fused kernels: (B, H, N, Dv) in v's
    dtype, and the engine's state after the last key ((B, H, Dv + 1, F), float32) where
    ``want_state``, else None. ``keep`` (B, N) or (B, H, N): False where a key is padding
    (its features already zero); ``state``: the engine's ``weighted_state`` of the keys
    before, not differentiated."""
    check_device(qs, "triton")
    b, h, n, d = qs.shape
    if why := refusal(d, v.shape[-1]):
        raise ValueError(f"attention.backend=triton: {why}; use attention.backend=auto")
    if state is not None and state.requires_grad:
        raise ValueError(
            "attention.backend=triton does not differentiate the state it starts from; pass it "
            "detached, or use attention.backend=loop"
        )
    m = None
    if keep is not None:
        m = (keep[:, None] if keep.dim() == 2 else keep).expand(b, h, n).to(v.dtype)
        v = v * m[..., None]
    parts = None if state is None else from_engine(state)
    chunk = chunk or chunk_for(qs.dtype)
    y, *out = _TritonFastmax.apply(qs, ks, v, m, parts, want_state or state is not None, chunk)
    return y, (to_engine(dict(zip(PARTS, out, strict=True)), b, h) if want_state else None)
