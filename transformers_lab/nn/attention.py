"""Multi-head attention: the projections around an interchangeable attention kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from torch import Tensor, nn

from transformers_lab.attention import AttentionKernel, Memory, kernel_class
from transformers_lab.nn.rotary import Rotary

KernelFactory = Callable[..., AttentionKernel]
# A cross-attention context: the memory (B, Nk, dim), or the kernel's prepared Memory of
# it from ``MultiHeadAttention.project_context``.
Context = Tensor | Memory | None


def head_size(d_model: int, num_heads: int) -> int:
    """The width of one head: ``d_model`` split evenly over ``num_heads``."""
    if num_heads <= 0 or d_model % num_heads != 0:
        raise ValueError(
            f"d_model={d_model} must be divisible by num_heads={num_heads}; "
            "choose num_heads among the divisors of d_model"
        )
    return d_model // num_heads


def as_kernel_factory(kernel: KernelFactory | str) -> KernelFactory:
    """A kernel factory from a factory or from a registered kernel name."""
    return partial(kernel_class(kernel)) if isinstance(kernel, str) else kernel


def refuse_causal(modules: Iterable[nn.Module], model: str) -> None:
    """Raise a ValueError if a kernel of ``modules``, which ``model`` calls causally,
    cannot attend causally (its ``causal_refusal``)."""
    for module in modules:
        for kernel in module.modules():
            if isinstance(kernel, AttentionKernel) and (why := kernel.causal_refusal()):
                raise ValueError(f"{model} attends causally: {why}")


class MultiHeadAttention(nn.Module):
    """Projects tokens to per-head q, k, v, runs the kernel on all heads at once, and
    projects the heads back.

    Self-attention uses one fused ``d_model -> 3 d_model`` projection. Cross-attention
    (``cross=True``) projects queries from ``x`` and keys/values from ``context``.

    Args:
        d_model: token width; must divide by ``num_heads``.
        num_heads: H.
        kernel: ``factory(head_dim=..., num_heads=...)`` returning an ``AttentionKernel``
            (Hydra's ``_partial_: true`` gives one), or a kernel name such as ``"fastmax"``.
        cross: attend from ``x`` to a separate ``context``.
        context_dim: width of ``context`` (cross-attention only); ``None`` means d_model.
        bias: bias in the projections.
        dropout: dropout on the output projection (the residual branch). Dropout on the
            attention weights belongs to the kernel.
        rope_theta: rotate queries and keys by their positions before the kernel (RoPE,
            ``nn.rotary``) with this base; None: no rotation. Self-attention only.
        alibi: add ALiBi's head-sloped distance bias to the kernel's scores
            (``AttentionKernel.use_alibi``; a kernel that forms none refuses). Self-attention
            only.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        kernel: KernelFactory | str = "softmax",
        *,
        cross: bool = False,
        context_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rope_theta: float | None = None,
        alibi: bool = False,
    ) -> None:
        super().__init__()
        if context_dim is not None and not cross:
            raise ValueError("context_dim is only used with cross=True (cross-attention)")
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = head_size(d_model, num_heads)
        self.cross = cross
        if cross:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            self.kv_proj = nn.Linear(context_dim or d_model, 2 * d_model, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        if rope_theta is not None and cross:
            raise ValueError("rope_theta is for self-attention: a context has positions of its own")
        self.rotary = None if rope_theta is None else Rotary(self.head_dim, rope_theta)
        self.kernel = as_kernel_factory(kernel)(head_dim=self.head_dim, num_heads=num_heads)
        if not isinstance(self.kernel, AttentionKernel):
            raise TypeError(
                f"the kernel factory returned {type(self.kernel).__name__}, expected an "
                "AttentionKernel; pass a kernel name or a partial of a kernel class"
            )
        if cross and getattr(self.kernel, "positional", False):
            raise ValueError(
                f"attention={self.kernel.name} weighs keys by their positions in one sequence, "
                "which a cross-attention's queries and keys do not share; give the model "
                "another cross_attention kernel (model.cross_attention=...)"
            )
        if alibi:
            if cross:
                raise ValueError("alibi is for self-attention: a context is another sequence")
            self.kernel.use_alibi()

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, N, d_model) -> (B, H, N, head_dim)."""
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def project_context(self, context: Tensor, key_padding_mask: Tensor | None = None) -> Memory:
        """Keys and values of a cross-attention context (B, Nk, dim), prepared by the kernel
        (the factorised state for fastmax). Pass the result back as ``context`` to attend
        to the same memory many times, as a decoder does at every step, without projecting
        or summarising it again; its padding mask goes with it."""
        if not self.cross:
            raise ValueError("project_context() is for cross-attention (cross=True) layers")
        if context.dim() != 3:
            raise ValueError(
                f"expected a context of shape (batch, tokens, dim), got {tuple(context.shape)}"
            )
        k, v = self.kv_proj(context).split(self.d_model, dim=-1)
        return self.kernel.memory(self.split_heads(k), self.split_heads(v), key_padding_mask)

    def project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head queries, keys and values, each (B, H, N, head_dim)."""
        self._check_x(x)
        if self.cross:
            if context is None:
                raise ValueError("cross-attention needs a context tensor (batch, tokens, dim)")
            k, v = self.kv_proj(context).split(self.d_model, dim=-1)
            return self.split_heads(self.q_proj(x)), self.split_heads(k), self.split_heads(v)
        if context is not None:
            raise ValueError("a self-attention layer takes no context; build it with cross=True")
        q, k, v = self.qkv_proj(x).split(self.d_model, dim=-1)
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        return q, k, v

    def queries(self, x: Tensor) -> Tensor:
        """A cross-attention's per-head queries of x (B, Nq, d_model): (B, H, Nq, head_dim)."""
        self._check_x(x)
        return self.split_heads(self.q_proj(x))

    def _check_x(self, x: Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"expected x of shape (batch, tokens, d_model={self.d_model}), got {tuple(x.shape)}"
            )

    def merge_heads(self, out: Tensor) -> Tensor:
        """(B, H, N, head_dim) -> output projection of (B, N, d_model)."""
        b, _, n, _ = out.shape
        out = out.transpose(1, 2).reshape(b, n, self.d_model)
        return self.resid_dropout(self.out_proj(out))

    def forward(
        self,
        x: Tensor,
        context: Context = None,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """x (B, Nq, d_model), context (B, Nk, context_dim) or its prepared Memory
        -> (B, Nq, d_model)."""
        if isinstance(context, Memory):  # the mask travels inside the memory
            out = self.kernel.read_memory(self.queries(x), context)
            return self.merge_heads(out)
        q, k, v = self.project(x, context)
        out = self.kernel(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        return self.merge_heads(out)

    def attention_weights(
        self,
        x: Tensor,
        context: Context = None,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The attention matrix of every head, (B, H, Nq, Nk), for inspection. A prepared
        ``Memory`` serves as the context where it kept its keys (its mask goes with it)."""
        if isinstance(context, Memory):
            if context.keys is None:
                raise ValueError(
                    f"attention={self.kernel.name}'s prepared memory keeps a summary of the "
                    "keys, not the keys: pass the context tensor to attention_weights()"
                )
            q, k = self.queries(x), context.keys
            if key_padding_mask is None:
                key_padding_mask = context.key_padding_mask
        else:
            q, k, _ = self.project(x, context)
        return self.kernel.weights(q, k, causal=causal, key_padding_mask=key_padding_mask)

    def decode(
        self, x: Tensor, state: Any = None, *, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Any]:
        """Causal self-attention of new tokens x (B, T, d_model) over the cached past."""
        if self.cross:
            raise ValueError("decode() is for self-attention; cross-attention keys are fixed")
        if self.rotary is None:
            q, k, v = self.project(x, None)
            out, state = self.kernel.decode(q, k, v, state, key_padding_mask=key_padding_mask)
            return self.merge_heads(out), state
        # with RoPE the state also counts the tokens seen: the new ones' positions follow
        kernel_state, seen = (None, 0) if state is None else state
        self._check_x(x)
        q, k, v = (self.split_heads(t) for t in self.qkv_proj(x).split(self.d_model, dim=-1))
        q, k = self.rotary(q, seen), self.rotary(k, seen)
        out, kernel_state = self.kernel.decode(
            q, k, v, kernel_state, key_padding_mask=key_padding_mask
        )
        return self.merge_heads(out), (kernel_state, seen + x.shape[1])
