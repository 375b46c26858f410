"""The parts of an attention layer around its kernel: their switches (``LayerParts``) and
their modules (the short convolution, the per-head output norm, the q/k activations).

A layer is: projections -> (short convolution) -> (activation, L2 norm of q and k) ->
positions -> kernel -> (per-head norm, output gate) -> output projection. Each part in
brackets is a switch of the attention config (``conf/layer/parts.yaml``), off by default,
so a kernel runs bare unless asked; a preset switches on what its paper's layer uses::

    tlab-train experiment=mqar attention=fastmax_p2 attention.short_conv=4

The switches ride in the attention config beside the kernel's own options; the layer
(``nn.multihead.MultiHeadAttention``) takes them out of the kernel's factory
(``split_layer_parts``) before it builds the kernel, which never sees them."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")


@dataclass(frozen=True)
class LayerParts:
    """The switches of the parts around a kernel (all off: the bare kernel).

    Args:
        short_conv: K > 0: a depthwise causal convolution of width K over each channel of
            the projected q, k and v, then SiLU (fla's ShortConvolution); 0: none.
        qk_activation: an activation of q and k after the convolution (``silu``, ``relu``,
            ``elu``); None: none.
        qk_norm: divide each head's q and k by their L2 norms (before positions).
        output_norm: RMS-normalise each head's output, with a learned gain per channel.
        output_gate: multiply the output by swish(W_g x), a gate projected from the layer's
            input x (GLA, DeltaNet, RetNet).
    """

    short_conv: int = 0
    qk_activation: str | None = None
    qk_norm: bool = False
    output_norm: bool = False
    output_gate: bool = False

    def __post_init__(self) -> None:
        k = self.short_conv
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(
                f"attention.short_conv must be an integer >= 0 (the convolution's width; 0 "
                f"is off), got {k!r}"
            )
        if self.qk_activation is not None and self.qk_activation not in QK_ACTIVATIONS:
            raise ValueError(
                f"unknown attention.qk_activation {self.qk_activation!r}; valid ones are: "
                f"{', '.join(QK_ACTIVATIONS)} (or null for none)"
            )
        for name in ("qk_norm", "output_norm", "output_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"attention.{name} must be true or false, got {getattr(self, name)!r}"
                )

    def switched_on(self) -> list[str]:
        """The parts that are on, as ``key=value`` (the README's kernel table)."""
        default = LayerParts()
        return [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]


PART_KEYS = tuple(f.name for f in fields(LayerParts))


def split_layer_parts(kernel: Any) -> tuple[Any, LayerParts]:
    """A kernel factory without the layer's switches, and the switches: an attention
    config (Hydra's partial of a kernel class) carries both. Anything else (a kernel's
    name, a factory of the user's) carries none."""
    if not isinstance(kernel, partial):
        return kernel, LayerParts()
    switches = {k: v for k, v in kernel.keywords.items() if k in PART_KEYS}
    if not switches:
        return kernel, LayerParts()
    options = {k: v for k, v in kernel.keywords.items() if k not in PART_KEYS}
    return partial(kernel.func, *kernel.args, **options), LayerParts(**switches)


class _ShiftedSum(torch.autograd.Function):
    """The causal depthwise convolution of x (B, L, C) whose first ``h`` rows are history:
    out[:, j] = sum_i w[i] * x[:, j + h - (K - 1) + i], rows before 0 read as zeros, for
    the T = L - h rows after the history. K shifted multiply-adds over (B, T, C) slices
    forward, K more and K column sums backward, each weight row contiguous: no padding, no
    transposes. On a CPU (1 x 4096 x 384, K = 4, 2 threads) forward and backward take about
    5 ms, against 47 for a depthwise ``conv1d`` (the rows of a (C, K) weight read with
    stride K made it 4x slower)."""

    @staticmethod
    def forward(ctx, x, w, h):  # type: ignore[override]
        k, t = w.shape[0], x.shape[1] - h
        out = x[:, h:] * w[k - 1]
        for s in range(1, k):
            j0 = max(0, s - h)
            if j0 < t:
                out[:, j0:].addcmul_(x[:, j0 + h - s : t + h - s], w[k - 1 - s])
        ctx.save_for_backward(x, w)
        ctx.h = h
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w = ctx.saved_tensors
        h, k, t = ctx.h, w.shape[0], grad.shape[1]
        d_x = torch.empty_like(x)
        d_x[:, :h].zero_()
        torch.mul(grad, w[k - 1], out=d_x[:, h:])
        d_w = torch.zeros_like(w)
        d_w[k - 1] = (grad * x[:, h:]).sum((0, 1))
        for s in range(1, k):
            j0 = max(0, s - h)
            if j0 < t:
                rows = slice(j0 + h - s, t + h - s)
                d_x[:, rows].addcmul_(grad[:, j0:], w[k - 1 - s])
                d_w[k - 1 - s] = (grad[:, j0:] * x[:, rows]).sum((0, 1))
        return d_x, d_w, None


class ShortConvolution(nn.Module):
    """A depthwise causal convolution of width K over the channels of (B, N, C), then SiLU:
    output t reads inputs t - K + 1 .. t of its own channel. Decoding keeps the last K - 1
    inputs, so a new token costs O(K) whatever the context.

    Initialised as ``nn.Conv1d`` is (uniform in +-1/sqrt(K)); by default without a bias
    and with SiLU, as fla's ShortConvolution is (Zoology's BaseConv: a bias, no SiLU).
    """

    def __init__(self, channels: int, width: int, *, silu: bool = True, bias: bool = False) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"the short convolution's width must be >= 1, got {width}")
        self.width = width
        self.silu = silu
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv1d's own init
        self.bias = None
        if bias:  # nn.Conv1d's: uniform in +-1/sqrt(fan_in), fan_in = K
            self.bias = nn.Parameter(torch.empty(channels).uniform_(-1, 1) / math.sqrt(width))

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, width={self.width}"

    def forward(self, x: Tensor, past: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x (B, T, C) and the K - 1 inputs before it (None: zeros, the sequence's start)
        -> the output (B, T, C) and the last K - 1 inputs, the state for the next call."""
        k = self.width
        weight = self.weight[:, 0].t().to(x.dtype).contiguous()  # (K, C): rows contiguous
        if past is None:  # the sequence's start: the rows before it are zeros
            full, out = x, _ShiftedSum.apply(x, weight, 0)
        else:
            full = torch.cat([past.to(x.dtype), x], dim=1)  # (B, K - 1 + T, C)
            out = _ShiftedSum.apply(full, weight, k - 1)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        if self.silu:
            out = F.silu(out)
        return out, self.last_inputs(full)

    def last_inputs(self, full: Tensor) -> Tensor:
        """The K - 1 inputs the next call reads as its past: the last of ``full``, after
        zeros where it holds fewer."""
        need = self.width - 1
        if full.shape[1] < need:
            full = F.pad(full, (0, 0, need - full.shape[1], 0))
        return full[:, full.shape[1] - need :]


class HeadNorm(nn.Module):
    """RMS norm of each head's output (B, H, N, D) over D, with a learned gain per channel
    shared by the heads (the per-head norm of GLA, RetNet and DeltaNet's output)."""

    def __init__(self, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # half precision in float32
        rms = h.pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()
        return (h * rms).to(x.dtype) * self.weight


def qk_activation(x: Tensor, name: str | None) -> Tensor:
    """q or k through the activation ``name`` (None or ``identity``: as is)."""
    if name in (None, "identity"):
        return x
    return {"silu": F.silu, "relu": F.relu, "elu": F.elu}[name](x)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x over its last dim's L2 norm (a zero vector stays zero)."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)
