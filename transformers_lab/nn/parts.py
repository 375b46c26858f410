"""The modules of an attention layer's parts around its kernel (``attention.parts`` holds
their switches): the short convolution, the per-head output norm, the q/k activations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _ShiftedSum(torch.autograd.Function):
    """out[:, t] = sum_i w[:, i] * full[:, t + i], the causal depthwise convolution as K
    shifted multiply-adds over contiguous (B, T, C) slices, with a backward of K more and
    K column sums: no transposes, and on a CPU about 3x faster than a depthwise
    ``conv1d`` forward and backward (1 x 4096 x 384, K=4, 2 threads: 16 ms against 47)."""

    @staticmethod
    def forward(ctx, full, w, t):  # type: ignore[override]
        k = w.shape[1]
        out = full[:, k - 1 :] * w[:, k - 1]
        for i in range(k - 1):
            out.addcmul_(full[:, i : i + t], w[:, i])
        ctx.save_for_backward(full, w)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        full, w = ctx.saved_tensors
        k, t, c = w.shape[1], grad.shape[1], grad.shape[2]
        d_full = torch.zeros_like(full)
        flat = grad.reshape(-1, c)
        d_w = []
        for i in range(k):
            d_full[:, i : i + t].addcmul_(grad, w[:, i])
            d_w.append((full[:, i : i + t].reshape(-1, c) * flat).sum(0))
        return d_full, torch.stack(d_w, 1), None


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
        b, t, c = x.shape
        k = self.width
        if past is None:
            past = x.new_zeros(b, k - 1, c)
        full = torch.cat([past.to(x.dtype), x], dim=1)  # (B, K - 1 + T, C)
        out = _ShiftedSum.apply(full, self.weight[:, 0].to(x.dtype), t)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        if self.silu:
            out = F.silu(out)
        return out, full[:, full.shape[1] - (k - 1) :]


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
