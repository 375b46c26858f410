"""Fastmax: factorizable polynomial attention (Gerami et al., "FAST: Factorizable Attention
for Speeding up Transformers", arXiv 2402.07901, 2024).

The softmax's exponential is replaced by its Taylor polynomial of order p (1 or 2)::

    a_ij = f(x_ij) / sum_j f(x_ij),   x_ij = s * q_i . k_j,   f(x) = sum_{m<=p} x^m / m!

f factorises over features of q and k (1 + D + D(D+1)/2 of them for p=2, the symmetric
half of q~ (x) q~), so time and memory grow linearly with the sequence: the paths are
those of every linear kernel (``attention.feature_map``). This file holds fastmax's own part,
its features (each token by its own norm, queries scaled) and its float64 reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformers_lab.attention import naive
from transformers_lab.attention.feature_map.feature_kernel import FeatureKernel
from transformers_lab.attention.feature_map.features import SUPPORTED_P
from transformers_lab.attention.triton_ops import refusal as triton_refusal


class FastmaxAttention(FeatureKernel):
    """Fastmax attention of Taylor order ``p``, linear in sequence length.

    Args:
        p: Taylor order, 1 or 2. ``p=2`` is positive for every score. ``p=1`` is positive
            only when ``|s q.k| <= 1``, so it requires ``normalize=True`` and ``scale <= 1``.
        scale: s, multiplies q.k before the polynomial.
        normalize: ``true`` (or ``"token"``): divide every query and key by its own L2
            norm; the norm of each token uses that token alone, so nothing leaks from the
            future. ``"sequence_max"``: the authors' choice (``fastmax_function`` of
            armingerami/fastmax): divide every query (key) by the largest query (key) norm
            of its sequence, per batch and head; that norm reads later tokens, so it is
            refused with ``causal=True``. ``false``: q and k as they come.
        learn_scale: learn s per head, as ``log s`` (initially ``scale``; at most 1 for
            p=1, where larger would make weights negative), as cosine learns its τ.
        chunk_size: C, the tokens processed at once by the linear paths.
        impl: ``"linear"`` (factorized / chunked), ``"quadratic"`` (the reference) or
            ``"auto"``: quadratic while the keys are no more than the feature dimension
            (D + 1 for p=1, about D^2 / 2 for p=2), where the N x N form is the cheaper in
            time and memory (at N=32, D=32 about 35x faster), linear beyond. Both give
            the same result; incremental decoding always uses the recurrent state.
        compiled: the linear paths' chunk steps through ``torch.compile`` (as for every
            linear kernel, ``FeatureKernel``).
        dropout: drops whole keys. During training each (batch, head, key) is kept with
            probability 1 - dropout and its value scaled by 1 / (1 - dropout); the
            normaliser is unchanged, so, as with dropout on an attention matrix, the
            expected output is unchanged. Dropping single (query, key) weights would need
            the N x N matrix that the linear paths never build.
        eps: guards the norm of an all-zero query or key.
        backend: what runs the training forward (``FeatureKernel``): ``auto``, ``loop``,
            ``fla`` (p=1: ``chunk_linear_attn`` on [1, s q], [1, k]; p=2: ``parallel_based``
            on s q and k, D <= 128), ``flex`` (softmax of log f(x), FlexAttention) or, for
            p=2, ``triton`` (our Triton kernel, linear in N: ``triton_ops``; D of 16, 32, 64
            or 128; ``auto`` does not take it yet).

    Under autocast (fp16 / bf16) the states are accumulated in float32.
    """

    name = "fastmax"
    fused_backends = ("fla", "flex", "triton")
    labelled = ("p",)
    formula = "Σ_{m≤p} (s q·k)^m / m!, normalised over keys"

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        p: int = 2,
        scale: float = 1.0,
        normalize: bool | str = True,
        learn_scale: bool = False,
        chunk_size: int = 128,
        impl: str = "auto",
        compiled: bool = False,
        backend: str | None = "auto",
        eps: float = 1e-6,
    ) -> None:
        super().__init__(
            head_dim,
            n_head,
            dropout,
            p=p,
            chunk_size=chunk_size,
            impl=impl,
            compiled=compiled,
            backend=backend,
        )
        if p not in SUPPORTED_P:
            raise ValueError(
                f"fastmax: unsupported Taylor order p={p!r}; supported orders are {SUPPORTED_P}"
            )
        modes = {True: "token", False: "none", "token": "token", "none": "none"}
        modes["sequence_max"] = "sequence_max"
        if normalize not in modes:
            raise ValueError(
                f"fastmax: normalize must be true, false, 'token' or 'sequence_max', "
                f"got {normalize!r}"
            )
        self.norm_mode = modes[normalize]
        if p == 1 and (self.norm_mode == "none" or scale > 1.0):
            raise ValueError(
                "fastmax p=1 gives negative attention weights when |scale * q.k| > 1: "
                f"got normalize={normalize}, scale={scale}. Set normalize=true and scale <= 1, "
                "or use p=2, which is positive for every score."
            )
        if scale <= 0:
            raise ValueError(f"fastmax: scale must be positive, got {scale}")
        if self.backend == "triton" and p != 2:
            raise ValueError(
                f"fastmax: attention.backend=triton is a kernel for p=2, got p={p}; use "
                "attention.backend=auto (fla's kernel for p=1 on CUDA)"
            )
        if self.backend == "triton" and (why := triton_refusal(head_dim)):
            raise ValueError(
                f"fastmax: attention.backend=triton: {why}; use attention.backend=auto"
            )
        self.scale = float(scale)
        self.normalize = normalize
        self.learn_scale = learn_scale
        self.eps = eps
        self.max_log_scale = 0.0 if p == 1 else math.inf  # p=1: s <= 1
        if learn_scale:
            self.log_scale = nn.Parameter(torch.full((n_head, 1, 1), math.log(scale)))

    def temperature(self) -> Tensor | float:
        """s: the float ``scale``, or the learned per-head (H, 1, 1), clamped for p=1."""
        if not self.learn_scale:
            return self.scale
        return self.log_scale.clamp(max=self.max_log_scale).exp()

    @property
    def pools_queries(self) -> bool:  # type: ignore[override]
        """sequence_max divides each query by the largest query norm of its sequence."""
        return self.norm_mode == "sequence_max"

    def causal_refusal(self) -> str | None:
        """Why this kernel cannot attend causally, or None."""
        if self.norm_mode != "sequence_max":
            return None
        return (
            "fastmax normalize=sequence_max divides every token by the largest norm of its "
            "whole sequence, so each position would see the future; use it without a causal "
            "mask (an encoder, a ViT), or normalize=true (each token by its own norm)"
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, **kw) -> Tensor:
        if causal and (why := self.causal_refusal()):
            raise ValueError(why)
        return super().forward(q, k, v, causal=causal, **kw)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, state=None, **kw):  # type: ignore[override]
        if why := self.causal_refusal():
            raise ValueError(why)
        return super().decode(q, k, v, state, **kw)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, p={self.p}, scale={self.scale}, "
            f"normalize={self.normalize}, learn_scale={self.learn_scale}"
        )

    def features(self, x: Tensor, role: str) -> Tensor:
        """Queries and keys normalised as ``normalize`` says; queries times s."""
        if self.norm_mode == "token":
            x = F.normalize(x, dim=-1, eps=self.eps)
        elif self.norm_mode == "sequence_max":
            largest = x.norm(dim=-1, keepdim=True).amax(dim=-2, keepdim=True)
            x = x / largest.clamp(min=self.eps)
        if role != "q":
            return x
        return x * self.temperature().to(x.dtype) if self.learn_scale else x * self.scale

    def reference_weights(
        self, q: Tensor, k: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None
    ) -> Tensor:
        """``f(x_ij) / sum_j f(x_ij)`` with ``f(x) = sum_{m<=p} x^m / m!`` and
        ``x = s q·k`` (q and k normalised as ``normalize`` says), in float64."""
        if self.norm_mode == "token":
            q, k = naive.unit(q), naive.unit(k)
        elif self.norm_mode == "sequence_max":  # padded tokens are zero (prepare), count not
            q, k = q.double(), k.double()
            if key_padding_mask is not None:
                keep = ~key_padding_mask[:, None, :, None]
                k = torch.where(keep, k, 0.0)
                q = torch.where(keep, q, 0.0) if q.shape[-2] == k.shape[-2] else q
            q = q / q.norm(dim=-1).amax(dim=-1)[..., None, None]
            k = k / k.norm(dim=-1).amax(dim=-1)[..., None, None]
        s = self.temperature()
        s = s.double() if isinstance(s, Tensor) else s
        x = s * naive.dot(q, k)
        f = sum(x**m / math.factorial(m) for m in range(self.p + 1))
        return naive.normalise_rows(f, naive.pair_mask(q, k, causal, key_padding_mask))
