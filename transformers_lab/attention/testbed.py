"""What the kernel check (``check``) runs a kernel on: the kernel under test, built in
float64 with its learned parameters moved off their initial values and its gate inputs
drawn from its keys (``build``); the device it runs on (``check_device``); the queries,
keys, values and padding it is called with (``qkv``, ``padding``); the values of
``causal`` it takes (``modes``); and how far apart two results are (``gap``). The
layer's checks (``nn.check``) run on the same bed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.contract import call_with_heads

B, H, D, DV = 2, 3, 8, 5  # batch, heads, the width of q and k, the width of v
Factory = Callable[..., AttentionKernel]


class CheckError(ValueError):
    """The target cannot be resolved or built, or run where it is asked to."""


# ---------------------------------------------------------------- the kernel under test


def with_alibi(factory: Factory) -> Factory:
    """The factory's kernels with ALiBi's bias on their scores (``use_alibi``)."""

    def build_with_alibi(head_dim: int, n_head: int) -> AttentionKernel:
        kernel = call_with_heads(factory, n_head, head_dim=head_dim)
        kernel.use_alibi()
        return kernel

    return build_with_alibi


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """The module in float64 and eval mode, its parameters moved off their initial values
    (so that a reference that ignored one would be caught)."""
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module.eval()


def build(factory: Factory) -> AttentionKernel:
    """The float64 kernel under test; a kernel with gate inputs gets them from its keys
    (``gated``)."""
    kernel = perturbed(call_with_heads(factory, H, head_dim=D))
    return gated(kernel) if kernel.gate_inputs else kernel


def gated(kernel: AttentionKernel) -> AttentionKernel:
    """The kernel, its gate inputs supplied at every call as a fixed function of each
    token's keys (its activation of ``k @ W`` for a fixed W: of each key for a gate one a
    key, of the token's keys side by side for one a token), so that forward, decode and
    the checks' changed keys all see the gates their tokens would have."""
    gates, d, n = kernel.gate_inputs, kernel.qk_dim, kernel.keys_per_token
    weights = {
        name: torch.randn(d if g.per_key else n * d, d if g.per_channel else 1, dtype=torch.float64)
        for name, g in gates.items()
    }

    def values(k: Tensor) -> dict[str, Tensor]:
        b, h, steps, _ = k.shape
        by_token = k.reshape(b, h, steps // n, n * d)  # a token's keys side by side
        out = {}
        for name, gate in gates.items():
            g = (k if gate.per_key else by_token) @ weights[name].to(k)
            out[name] = gate.activate(g if gate.per_channel else g.squeeze(-1))
        return out

    base = type(kernel)

    class Gated(base, register=False):  # type: ignore[valid-type, misc]
        def forward(self, q, k, v, **kw):  # type: ignore[no-untyped-def, override]
            return super().forward(q, k, v, **{**values(k), **kw})

        def weights(self, q, k, **kw):  # type: ignore[no-untyped-def, override]
            return super().weights(q, k, **{**values(k), **kw})

        def reference_weights(self, q, k, **kw):  # type: ignore[no-untyped-def, override]
            return super().reference_weights(q, k, **{**values(k), **kw})

        def decode(self, q, k, v, state=None, **kw):  # type: ignore[no-untyped-def, override]
            return super().decode(q, k, v, state, **{**values(k), **kw})

    Gated.__name__ = Gated.__qualname__ = base.__name__
    if base.reference_weights is AttentionKernel.reference_weights:
        Gated.reference_weights = AttentionKernel.reference_weights  # type: ignore[method-assign]
    kernel.__class__ = Gated
    return kernel


# ---------------------------------------------------------------- where and with what it runs


def check_device(name: str) -> torch.device:
    """The device the checks run on; one line if it is not there."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CheckError(f"--device {name!r} is not a device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise CheckError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    if device.type not in ("cpu", "cuda"):
        raise CheckError(f"--device {name!r}: the checks run on cpu or cuda")
    return device


def qkv(
    kernel: AttentionKernel, nq: int, nk: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries and keys as wide as the kernel takes them (``qk_dim``), values DV wide; nk
    tokens of keys and values, ``keys_per_token`` keys a token; keys of norm 1 for a kernel
    that takes them so (``unit_keys``)."""
    d, steps = kernel.qk_dim, nk * kernel.keys_per_token
    k = torch.randn(B, H, steps, d, dtype=dtype)
    return (
        torch.randn(B, H, nq, d, dtype=dtype),
        torch.nn.functional.normalize(k, dim=-1) if kernel.unit_keys else k,
        torch.randn(B, H, steps, DV, dtype=dtype),
    )


def tokens(kernel: AttentionKernel, t: Tensor, start: int, stop: int | None = None) -> Tensor:
    """Keys or values (B, H, N n, D) of tokens ``start`` .. ``stop`` - 1 (n keys a token)."""
    n = kernel.keys_per_token
    return t[:, :, start * n : None if stop is None else stop * n]


def padding(nk: int) -> Tensor:
    """Batch 0 unpadded, batch 1 with its last two keys padded."""
    mask = torch.zeros(B, nk, dtype=torch.bool)
    mask[1, -2:] = True
    return mask


def modes(kernel: AttentionKernel) -> tuple[bool, ...]:
    """The values of ``causal`` a kernel takes: both, or the one it does not refuse."""
    if kernel.causal_refusal():
        return (False,)
    if kernel.noncausal_refusal():
        return (True,)
    return (False, True)


# ---------------------------------------------------------------- what it gives


def gap(a: Tensor, b: Tensor, rtol: float, atol: float) -> str | None:
    """None when a and b agree within rtol, atol; else how far apart they are."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=False):
        return None
    diff = (a.double() - b.double()).abs().nan_to_num(torch.inf)
    return f"max abs diff {diff.max().item():.3g}"


def state_numbers(state: Any) -> int:
    """The numbers a decode state holds (its floating-point tensors, masks aside)."""
    if isinstance(state, Tensor):
        return state.numel() if state.is_floating_point() else 0
    if isinstance(state, (tuple, list)):
        return sum(state_numbers(s) for s in state)
    if isinstance(state, dict):
        return sum(state_numbers(s) for s in state.values())
    return 0
