"""Multi-head attention: the projections around an interchangeable attention kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from transformers_lab.attention import AttentionKernel, Memory, kernel_class
from transformers_lab.attention.base import GateInput
from transformers_lab.attention.contract import call_with_heads
from transformers_lab.nn.parts import (
    HeadNorm,
    ShortConvolution,
    l2_normalize,
    qk_activation,
    split_layer_parts,
)
from transformers_lab.nn.rotary import Rotary

KernelFactory = Callable[..., AttentionKernel]
# A cross-attention context: the memory (B, Nk, dim), or the kernel's prepared Memory of
# it from ``MultiHeadAttention.project_context``.
Context = Tensor | Memory | None


def head_size(d_model: int, n_head: int) -> int:
    """The width of one head: ``d_model`` split evenly over ``n_head``."""
    if n_head <= 0 or d_model % n_head != 0:
        raise ValueError(
            f"d_model={d_model} must be divisible by n_head={n_head}; "
            "choose n_head among the divisors of d_model"
        )
    return d_model // n_head


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


def refuse_noncausal(modules: Iterable[nn.Module], model: str) -> None:
    """Raise a ValueError if a kernel of ``modules``, which ``model`` calls non-causally,
    can only attend causally (its ``noncausal_refusal``)."""
    for module in modules:
        for kernel in module.modules():
            if isinstance(kernel, AttentionKernel) and (why := kernel.noncausal_refusal()):
                raise ValueError(f"{model} attends both ways: {why}")


def refuse_short_positions(modules: Iterable[nn.Module], context: int | None, model: str) -> None:
    """Raise a ValueError if a kernel of ``modules`` weighs positions (``positional``) only
    up to a ``max_len`` shorter than ``model``'s context."""
    if context is None:
        return
    for module in modules:
        for kernel in module.modules():
            longest = getattr(kernel, "max_len", None)
            if getattr(kernel, "positional", False) and longest is not None and context > longest:
                raise ValueError(
                    f"{kernel.name} weighs positions up to its max_len={longest}, but "
                    f"{model}'s context is {context}; give the kernel max_len={context} "
                    f"(attention.max_len={context} for the model's own)"
                )


class LayerState(NamedTuple):
    """What a self-attention layer keeps between decoding calls: the kernel's state (a KV
    cache, a recurrent state), the short convolution's last K - 1 inputs, and the tokens
    seen (where the new ones' positions start, for RoPE)."""

    kernel: Any = None
    conv: Tensor | None = None
    seen: int = 0


class GateProjection(nn.Module):
    """The gate inputs a kernel declares (``GateInput``), projected from the layer's input
    x (B, N, d_model): each to (B, H, N), (B, H, N, D) per key channel, or (B, H, N n)
    one a key for a kernel that takes n keys a token (``keys_per_token``)."""

    def __init__(
        self,
        d_model: int,
        n_head: int,
        qk_dim: int,
        gates: dict[str, GateInput],
        keys_per_token: int = 1,
    ):
        super().__init__()
        self.n_head = n_head
        self.gates = dict(gates)
        self.keys_per_token = keys_per_token
        self.proj = nn.ModuleDict()
        for name, gate in self.gates.items():
            width = n_head * (qk_dim if gate.per_channel else keys_per_token if gate.per_key else 1)
            if gate.rank is None:
                self.proj[name] = nn.Linear(d_model, width)
            else:
                self.proj[name] = nn.Sequential(
                    nn.Linear(d_model, gate.rank, bias=False), nn.Linear(gate.rank, width)
                )

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        b, n, _ = x.shape
        out = {}
        for name, gate in self.gates.items():
            g = self.proj[name](x).view(b, n, self.n_head, -1).transpose(1, 2)
            if gate.per_key:  # (B, H, N n): a token's keys in a row
                g = g.reshape(b, self.n_head, -1)
            elif not gate.per_channel:  # (B, H, N, D) or (B, H, N)
                g = g.squeeze(-1)
            out[name] = gate.activate(g)
        return out


class MultiHeadAttention(nn.Module):
    """Projects tokens to per-head q, k, v, runs the kernel on all heads at once, and
    projects the heads back; the layer's parts (``nn.parts``) around the kernel::

        projections -> (short convolution) -> (activation, L2 norm of q, k) -> positions
        -> kernel (with its gate inputs) -> (per-head norm, output gate) -> output projection

    Self-attention uses one fused projection of x to q, k and v. Cross-attention
    (``cross=True``) projects queries from ``x`` and keys/values from ``context``. Values
    are ``head_dim = d_model / n_head`` wide a head; queries and keys are the kernel's
    ``qk_dim`` wide, ``head_dim`` too unless the kernel sets another (Based's
    ``feature_dim``: Zoology's Based projects x straight to its 16 features).

    Args:
        d_model: token width; must divide by ``n_head``.
        n_head: H.
        kernel: ``factory(head_dim=..., n_head=...)`` returning an ``AttentionKernel``
            (Hydra's ``_partial_: true`` gives one), or a kernel name such as ``"fastmax"``.
            Its config may carry the layer's switches (``nn.parts.LayerParts``:
            ``short_conv``, ``qk_activation``, ``qk_norm``, ``output_norm``,
            ``output_gate``): this module takes them out of the factory, keeps them as
            ``parts`` and builds them; the kernel never sees them.
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
        n_head: int,
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
        self.n_head = n_head
        self.head_dim = head_size(d_model, n_head)
        self.cross = cross
        # the layer's switches ride in the kernel's config: the layer takes them out
        factory, self.parts = split_layer_parts(as_kernel_factory(kernel))
        self.kernel = call_with_heads(factory, n_head, head_dim=self.head_dim)
        if not isinstance(self.kernel, AttentionKernel):
            raise TypeError(
                f"the kernel factory returned {type(self.kernel).__name__}, expected an "
                "AttentionKernel; pass a kernel name or a partial of a kernel class"
            )
        self.qk_dim = self.kernel.qk_dim
        qk_width = n_head * self.qk_dim
        # the widths of q, k and v in the projections' outputs: n keys and values a token
        # for a kernel that takes n (Gated DeltaProduct's n_h), laid out (n, H, D) as fla's
        self.keys_per_token = per_token = self.kernel.keys_per_token
        self.widths = (qk_width, per_token * qk_width, per_token * d_model)
        if cross:
            self.q_proj = nn.Linear(d_model, qk_width, bias=bias)
            self.kv_proj = nn.Linear(context_dim or d_model, qk_width + d_model, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, sum(self.widths), bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        if rope_theta is not None and cross:
            raise ValueError("rope_theta is for self-attention: a context has positions of its own")
        self.rotary = None if rope_theta is None else Rotary(self.qk_dim, rope_theta)
        if cross and (why := self.kernel.noncausal_refusal()):
            raise ValueError(f"a cross-attention attends to all of another sequence: {why}")
        if cross and getattr(self.kernel, "positional", False):
            raise ValueError(
                f"attention={self.kernel.name} weighs keys by their positions in one sequence, "
                "which a cross-attention's queries and keys do not share; give the model "
                "another cross_attention kernel (model.cross_attention=...)"
            )
        if cross and self.parts.short_conv:
            raise ValueError(
                f"attention.short_conv={self.parts.short_conv} convolves along one sequence, "
                "but a cross-attention's keys come from another; give the model a "
                "cross_attention without it (model.cross_attention=softmax, or a config "
                "with short_conv: 0)"
            )
        if cross and self.kernel.gate_inputs:
            raise ValueError(
                f"attention={self.kernel.name} takes inputs projected from each token "
                f"({', '.join(self.kernel.gate_inputs)}), which a cross-attention's keys, "
                "from another sequence, do not have; give the model another cross_attention "
                "kernel (model.cross_attention=...)"
            )
        if cross and per_token > 1:
            raise ValueError(
                f"attention={self.kernel.name} takes {per_token} keys a token from one "
                "sequence; give the model another cross_attention kernel "
                "(model.cross_attention=...)"
            )
        if alibi:
            if cross:
                raise ValueError("alibi is for self-attention: a context is another sequence")
            self.kernel.use_alibi()
        parts = self.parts
        self.conv = (
            None if not parts.short_conv else ShortConvolution(sum(self.widths), parts.short_conv)
        )
        self.gates = (
            GateProjection(d_model, n_head, self.qk_dim, self.kernel.gate_inputs, per_token)
            if self.kernel.gate_inputs
            else None
        )
        self.head_norm = HeadNorm(self.head_dim) if parts.output_norm else None
        self.gate_proj = nn.Linear(d_model, d_model, bias=bias) if parts.output_gate else None

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, N, H * width) -> (B, H, N, width): values, or queries and keys."""
        b, n, _ = x.shape
        return x.view(b, n, self.n_head, -1).transpose(1, 2)

    def split_keys(self, x: Tensor) -> Tensor:
        """(B, N, n H width) -> (B, H, N n, width): the keys or values of a kernel that takes
        n a token (``keys_per_token``), token t's at n t .. n t + n - 1; ``split_heads``
        for n = 1."""
        b, n, _ = x.shape
        per_token = self.keys_per_token
        x = x.view(b, n, per_token, self.n_head, -1).permute(0, 3, 1, 2, 4)
        return x.reshape(b, self.n_head, n * per_token, -1)

    def rotate_keys(self, k: Tensor, offset: int) -> Tensor:
        """RoPE of the keys (B, H, N n, D): each of a token's n keys at the token's position."""
        per_token = self.keys_per_token
        if per_token == 1:
            return self.rotary(k, offset)
        b, h, nn_, d = k.shape
        by_step = k.view(b, h, nn_ // per_token, per_token, d).transpose(2, 3)
        by_step = self.rotary(by_step.reshape(b, h * per_token, -1, d), offset)
        return by_step.view(b, h, per_token, -1, d).transpose(2, 3).reshape(b, h, nn_, d)

    def shape_qk(self, x: Tensor) -> Tensor:
        """Per-head queries or keys through the layer's activation and L2 norm."""
        x = qk_activation(x, self.parts.qk_activation)
        return l2_normalize(x) if self.parts.qk_norm else x

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
        k, v = self.context_kv(context)
        return self.kernel.memory(k, v, key_padding_mask)

    def context_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """A cross-attention's per-head keys and values of ``context``."""
        k, v = self.kv_proj(context).split(self.widths[1:], dim=-1)
        return self.shape_qk(self.split_heads(k)), self.split_heads(v)

    def project(
        self,
        x: Tensor,
        context: Tensor | None,
        state: LayerState | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per-head queries and keys (B, H, N, qk_dim) and values (B, H, N, head_dim)."""
        q, k, v, _ = self.project_with_state(x, context, state, key_padding_mask)
        return q, k, v

    def project_with_state(
        self,
        x: Tensor,
        context: Tensor | None,
        state: LayerState | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``project``, and the short convolution's state after x (None without one).
        ``state`` holds the tokens before x when decoding: the convolution's inputs and
        the count that RoPE's positions start from."""
        self._check_x(x)
        if self.cross:
            if context is None:
                raise ValueError("cross-attention needs a context tensor (batch, tokens, dim)")
            k, v = self.context_kv(context)
            return self.shape_qk(self.split_heads(self.q_proj(x))), k, v, None
        if context is not None:
            raise ValueError("a self-attention layer takes no context; build it with cross=True")
        state = state or LayerState()
        qkv = self.qkv_proj(x)
        conv_state = None
        if self.conv is not None:
            if key_padding_mask is not None:  # a padded token feeds no later token's window
                qkv = qkv.masked_fill(key_padding_mask[..., None], 0.0)
            qkv, conv_state = self.conv(qkv, state.conv)
        q, k, v = qkv.split(self.widths, dim=-1)
        q, k, v = self.split_heads(q), self.split_keys(k), self.split_keys(v)
        q, k = self.shape_qk(q), self.shape_qk(k)
        if self.rotary is not None:
            q, k = self.rotary(q, state.seen), self.rotate_keys(k, state.seen)
        return q, k, v, conv_state

    def queries(self, x: Tensor) -> Tensor:
        """A cross-attention's per-head queries of x (B, Nq, d_model): (B, H, Nq, qk_dim)."""
        self._check_x(x)
        return self.shape_qk(self.split_heads(self.q_proj(x)))

    def gate_values(self, x: Tensor) -> dict[str, Tensor]:
        """The kernel's gate inputs of the tokens x (none when it declares none)."""
        return {} if self.gates is None else self.gates(x)

    def _check_x(self, x: Tensor) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"expected x of shape (batch, tokens, d_model={self.d_model}), got {tuple(x.shape)}"
            )

    def merge_heads(self, out: Tensor, x: Tensor | None = None) -> Tensor:
        """(B, H, N, head_dim) -> (B, N, d_model): the per-head norm, the output gate of x
        (the layer's input), and the output projection."""
        if self.head_norm is not None:
            out = self.head_norm(out)
        b, _, n, _ = out.shape
        out = out.transpose(1, 2).reshape(b, n, self.d_model)
        if self.gate_proj is not None:
            if x is None:
                raise ValueError("the output gate needs the layer's input x")
            out = out * F.silu(self.gate_proj(x))
        return self.resid_dropout(self.out_proj(out))

    def state_size(self, n: int) -> int:
        """Numbers ``decode`` keeps per sequence after n tokens: the kernel's state and the
        short convolution's last K - 1 inputs."""
        conv = 0 if self.conv is None else (self.conv.width - 1) * sum(self.widths)
        return self.kernel.state_size(n) + conv

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
            return self.merge_heads(out, x)
        q, k, v = self.project(x, context, key_padding_mask=key_padding_mask)
        out = self.kernel(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, **self.gate_values(x)
        )
        return self.merge_heads(out, x)

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
            q, k, _ = self.project(x, context, key_padding_mask=key_padding_mask)
        return self.kernel.weights(
            q, k, causal=causal, key_padding_mask=key_padding_mask, **self.gate_values(x)
        )

    def decode(
        self, x: Tensor, state: LayerState | None = None, *, key_padding_mask: Tensor | None = None
    ) -> tuple[Tensor, LayerState]:
        """Causal self-attention of new tokens x (B, T, d_model) over the cached past;
        ``state`` is what the previous call returned (None at the start)."""
        if self.cross:
            raise ValueError("decode() is for self-attention; cross-attention keys are fixed")
        state = state or LayerState()
        q, k, v, conv = self.project_with_state(x, None, state, key_padding_mask)
        out, kernel_state = self.kernel.decode(
            q, k, v, state.kernel, key_padding_mask=key_padding_mask, **self.gate_values(x)
        )
        return self.merge_heads(out, x), LayerState(kernel_state, conv, state.seen + x.shape[1])

    def trim_state(self, state: LayerState | None, keep: int) -> LayerState | None:
        """``state`` with the kernel's state cut to its last ``keep`` tokens
        (``AttentionKernel.trim_state``); its positions go on counting (RoPE's keys keep
        their rotations: a query sees the same distances). None if the kernel cannot cut."""
        if state is None or state.kernel is None:
            return state
        kernel = self.kernel.trim_state(state.kernel, keep)
        return None if kernel is None else state._replace(kernel=kernel)
