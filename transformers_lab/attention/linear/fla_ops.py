"""fla's Triton kernels behind the gated recurrence: ``attention.backend=fla``.

flash-linear-attention (fla, ``pip install flash-linear-attention``) has a chunked Triton
kernel for each form of ``gated.chunked_recurrence`` that a gated kernel trains with:

| our recurrence                        | fla's op                         |
|---------------------------------------|----------------------------------|
| decay one number a head (B, H, N)     | ``chunk_simple_gla`` (``g``)      |
| decay one number a key channel        | ``chunk_gla`` (``g``)             |
| the delta rule, no decay              | ``chunk_delta_rule``              |
| the delta rule, decay a head          | ``chunk_gated_delta_rule``        |

Each takes the same log decay, rate beta and scale, in fla's layout (B, N, H, D) where
ours is (B, H, N, D), and should compute the same output: tests/gpu holds the two to
bf16's tolerance, a test that has not yet run to its end on a GPU (docs/benchmarks.md).
fla runs on CUDA only; decoding stays on our recurrence (one token: O(1) work, no kernel
to launch but a few products).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

# attention.backend: null, our chunk loop (any device), or fla, fla's Triton kernels (CUDA).
# null, not a name, so that a checkpoint saved before the option existed resumes
BACKENDS = (None, "fla")
INSTALL = "pip install flash-linear-attention"


def unavailable() -> str | None:
    """Why fla's kernels cannot run here (None: they can)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (fla's kernels are Triton kernels for CUDA)"
    try:
        importlib.import_module("fla.ops")
    except Exception as exc:  # not installed, or a Triton/torch it cannot work with
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"flash-linear-attention cannot be imported ({type(exc).__name__}: {why}); {INSTALL}"
    return None


def check_backend(name: str, backend: Any) -> None:
    """One line if ``backend`` is not one of ``BACKENDS``, or is fla where fla cannot run."""
    if backend not in BACKENDS:
        raise ValueError(
            f"{name}: backend={backend!r} is not one of null, fla; use attention.backend=null "
            "(our chunk loop, any device) or attention.backend=fla (fla's Triton kernels, CUDA)"
        )
    if backend == "fla" and (why := unavailable()):
        raise ValueError(f"{name}: attention.backend=fla cannot run here: {why}; "
                         "use attention.backend=null")  # fmt: skip


def fla_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    scale: float,
) -> Tensor:
    """``gated.chunked_recurrence``'s output o (B, H, N, Dv), from zero state, by fla's op
    for its form (the module doc's table), in q's dtype (the delta rule: bf16 or fp16)."""
    if q.device.type != "cuda":
        raise ValueError(
            f"attention.backend=fla runs on CUDA only, got tensors on {q.device.type}; move "
            "the model to a GPU (trainer=gpu) or use attention.backend=null"
        )
    if beta is not None and q.dtype == torch.float32:  # fla asserts it, in no words of ours
        raise ValueError(
            "attention.backend=fla: fla's delta rule runs in bf16 or fp16 only; train with "
            "trainer.precision=bf16-mixed (trainer=gpu does) or use attention.backend=null"
        )
    ops = importlib.import_module("fla.ops")

    def fla_layout(t: Tensor) -> Tensor:  # (B, H, N, ...) -> (B, N, H, ...)
        return t.transpose(1, 2).contiguous()

    q, k, v = fla_layout(q), fla_layout(k), fla_layout(v)
    g = None if log_decay is None else fla_layout(log_decay.float())
    if beta is None:
        if g is None:
            o, _ = ops.linear_attn.chunk_linear_attn(q, k, v, scale=scale, normalize=False)
        elif g.dim() == 3:
            o, _ = ops.simple_gla.chunk_simple_gla(q, k, v, g=g, scale=scale)
        else:
            o, _ = ops.gla.chunk_gla(q, k, v, g=g, scale=scale)
    else:
        beta = fla_layout(beta)
        if g is None:
            o, _ = ops.delta_rule.chunk_delta_rule(q, k, v, beta=beta, scale=scale)
        elif g.dim() == 3:
            o, _ = ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale)
        else:
            raise ValueError("the delta rule takes a decay of one number a head, (B, H, N)")
    return o.transpose(1, 2)
