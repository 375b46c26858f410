"""Rotary position embedding (RoPE; Su et al., "RoFormer", 2021).

Queries and keys are rotated, per head, before the kernel: the pair (x_i, x_{i + D/2})
of the token at position m turns by the angle m * theta^(-2i/D). Rotations keep dot
products between positions m and n a function of m - n, so a kernel whose weights depend
on q·k alone (softmax, dot, fastmax with per-token normalisation) sees relative
positions only. The positions of a decoding step start where the cache ends.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Rotary(nn.Module):
    """Rotates (B, H, N, D) queries or keys by their positions ``offset .. offset + N - 1``.

    Args:
        head_dim: D, even.
        theta: the base of the frequencies (10000 in RoFormer and Llama).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(
                "rope needs an even head dim (the query/key width of a head: d_model / n_head, "
                f"or the kernel's own, such as Based's feature_dim), got head_dim={head_dim}"
            )
        if theta <= 1:
            raise ValueError(f"rope_theta must be greater than 1, got {theta}")
        self.head_dim = head_dim
        self.theta = float(theta)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta:g}"

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        n = x.shape[2]
        # frequencies and angles in float32 at least, whatever x's dtype: in bf16 they
        # would be off by radians around position 1000
        dtype = torch.promote_types(x.dtype, torch.float32)
        exponents = torch.arange(0, self.head_dim, 2, device=x.device, dtype=dtype)
        inv_freq = self.theta ** -(exponents / self.head_dim)
        position = torch.arange(offset, offset + n, device=x.device, dtype=dtype)
        angles = position[:, None] * inv_freq[None, :]  # (N, D/2)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
