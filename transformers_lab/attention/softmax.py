"""Dot-product kernels: scaled softmax, unscaled dot (Luong) and cosine (Graves).

All three are ``softmax(s · q'·k')`` for some transform of q and k, so they share one fast
path, ``F.scaled_dot_product_attention`` (flash / memory-efficient backends where the
device has them), and one readable path, ``weights``, that builds the matrix explicitly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformers_lab.attention import naive
from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.masks import attention_mask, masked_softmax


class SoftmaxAttention(AttentionKernel):
    """Scaled dot-product attention, ``softmax(q·k / sqrt(D)) v`` (Vaswani et al., 2017).

    Args:
        scale: multiplies q·k before the softmax; ``None`` means ``1/sqrt(head_dim)``.
    """

    name = "softmax"
    forms_scores = True
    formula = "softmax(q·k/√D)"

    def __init__(
        self, head_dim: int, n_head: int, dropout: float = 0.0, scale: float | None = None
    ) -> None:
        super().__init__(head_dim, n_head, dropout)
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.4g}"

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, float]:
        """The (q', k', s) with scores ``s · q'·k'``; the identity transform here."""
        return q, k, self.scale

    def reference_scores(self, q: Tensor, k: Tensor) -> Tensor:
        """``s q·k`` in float64."""
        return self.scale * naive.dot(q, k)

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        allowed = naive.pair_mask(q, k, causal, key_padding_mask)
        scores = self.reference_scores(q, k) + self.reference_bias(q.shape[2], k.shape[2])
        return naive.softmax_rows(scores, allowed)

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        q, k, scale = self.prepare(q, k)
        scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Nq, Nk)
        scores = scores + self.score_bias(q.shape[2], k.shape[2], scores)
        allowed = attention_mask(
            q.shape[2],
            k.shape[2],
            causal=causal,
            key_padding_mask=key_padding_mask,
            device=q.device,
        )
        return masked_softmax(scores, allowed)

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
        q, k, scale = self.prepare(q, k)
        dropout_p = self.dropout if self.training else 0.0
        nq, nk = q.shape[2], k.shape[2]
        if self.alibi:  # a float mask: the bias, and -inf where a key may not be seen
            bias = self.score_bias(nq, nk, q)
            allowed = attention_mask(
                nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
            )
            if allowed is None:
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale
                )
            has_key = allowed.any(dim=-1, keepdim=True)
            mask = bias.masked_fill(~(allowed | ~has_key), -torch.inf)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale
            )
            return out.masked_fill(~has_key, 0.0)
        if key_padding_mask is None and (not causal or nq == nk):
            # SDPA's own causal mask is aligned top-left, which is right only when Nq == Nk.
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale
            )
        allowed = attention_mask(
            nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
        )
        # Rows with no visible key would give NaN; let them see everything, then zero them.
        has_key = allowed.any(dim=-1, keepdim=True)  # (·, ·, Nq, 1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed | ~has_key, dropout_p=dropout_p, scale=scale
        )
        return out.masked_fill(~has_key, 0.0)


class DotAttention(SoftmaxAttention):
    """Unscaled multiplicative attention, ``softmax(q·k) v`` (Luong et al., 2015)."""

    name = "dot"
    formula = "softmax(q·k)"

    def __init__(self, head_dim: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__(head_dim, n_head, dropout, scale=1.0)


class CosineAttention(SoftmaxAttention):
    """Cosine-similarity attention, ``softmax(tau_h · cos(q, k)) v``.

    The per-head temperature ``tau_h`` is learned as ``log tau`` and clamped to at most
    ``log(max_tau)`` (scaled cosine attention, Liu et al., Swin Transformer V2, 2022).
    Defaults: ``tau`` starts at 10 and never exceeds 100.

    Args:
        init_tau: the initial temperature of every head.
        max_tau: the largest temperature the clamp allows.
        eps: guards the norm of an all-zero query or key.
    """

    name = "cosine"
    formula = "softmax(τ_h·cos(q,k))"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        init_tau: float = 10.0,
        max_tau: float = 100.0,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(head_dim, n_head, dropout, scale=1.0)
        if not 0.0 < init_tau <= max_tau:
            raise ValueError(
                f"cosine: need 0 < init_tau <= max_tau, got init_tau={init_tau}, max_tau={max_tau}"
            )
        self.max_log_tau = math.log(max_tau)
        self.eps = eps
        self.log_tau = nn.Parameter(torch.full((n_head, 1, 1), math.log(init_tau)))

    def tau(self) -> Tensor:
        """The clamped per-head temperature, shape (H, 1, 1)."""
        return self.log_tau.clamp(max=self.max_log_tau).exp()

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, float]:
        q = F.normalize(q, dim=-1, eps=self.eps) * self.tau().to(q.dtype)
        k = F.normalize(k, dim=-1, eps=self.eps)
        return q, k, 1.0

    def reference_scores(self, q: Tensor, k: Tensor) -> Tensor:
        """``tau_h cos(q, k)`` in float64, tau clamped at max_tau."""
        tau = torch.exp(torch.clamp(self.log_tau.double(), max=self.max_log_tau))
        return tau * naive.dot(naive.unit(q), naive.unit(k))
