"""The attention-kernel contract shared by every kernel.

A kernel maps per-head queries, keys and values to per-head outputs::

    q (B, H, Nq, D), k (B, H, Nk, D), v (B, H, Nk, Dv)  ->  out (B, H, Nq, Dv)

- ``causal=True`` lets query ``i`` see key ``j`` only when ``j <= i + (Nk - Nq)``: the
  queries are aligned to the *last* Nq keys, as in incremental decoding.
- ``key_padding_mask`` is ``(B, Nk)`` bool, True where a key is padding. Padded keys never
  change any output. In self-attention (Nq == Nk) the same positions are padded queries:
  their rows are don't-care, and they never change another query's output either.
- A query whose every key is masked outputs zeros, never NaN.

``weights(q, k, ...)`` returns the explicit ``(B, H, Nq, Nk)`` attention matrix, so that
``forward == weights @ v`` when dropout is off. Its rows sum to 1 (or are all zero for a
fully masked query) when the kernel declares ``normalized = True``.

A kernel class registers itself under its ``name`` when it is defined (``REGISTRY``), and
carries its own reference, ``reference_weights``: the weights by its formula, written
naively in float64, against which the kernel check (``tlab-check``) holds the fast paths.
A new kernel is one file and one yaml.

The masks and ALiBi's bias that kernels which form scores share are in ``masks``; the
kernels that weigh each key on its own (sigmoid, ReLU) subclass ``keywise``'s base.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from transformers_lab.attention.contract import takes_backend
from transformers_lab.attention.masks import alibi_bias, alibi_slopes, attention_mask

log = logging.getLogger(__name__)


@dataclass
class Memory:
    """Keys and values prepared once by ``AttentionKernel.memory`` and read many times, as a
    decoder does with its source at every step. Kernels keep what they need: the keys,
    values and padding mask, or (fastmax) the factorised state of all keys."""

    keys: Tensor | None = None
    values: Tensor | None = None
    key_padding_mask: Tensor | None = None
    state: Tensor | None = None


GATE_ACTIVATIONS = ("sigmoid", "logsigmoid", "silu", "identity")


@dataclass(frozen=True)
class GateInput:
    """A per-token, per-head input a kernel declares (``AttentionKernel.gate_inputs``):
    multi-head attention projects it from the layer's input x, as fla's layers compute the
    delta rule's beta or a decay from x rather than from q or k, and passes it to
    ``forward`` and ``decode`` as a keyword argument of the gate's name.

    Args:
        activation: applied to the projection: ``sigmoid`` (a rate in (0, 1)),
            ``logsigmoid`` (a log-decay below 0), ``silu`` or ``identity``.
        per_channel: one value per key channel, (B, H, N, qk_dim), rather than one per
            head and token, (B, H, N).
        rank: project through a bottleneck of this width (GLA's low-rank gate); None: one
            linear map.
        per_key: one value per key the kernel takes, (B, H, N n) for a kernel that takes
            n = ``keys_per_token`` keys a token (Gated DeltaProduct's rate of each of its
            steps), rather than one per token.
    """

    activation: str = "sigmoid"
    per_channel: bool = False
    rank: int | None = None
    per_key: bool = False

    def __post_init__(self) -> None:
        if self.activation not in GATE_ACTIVATIONS:
            raise ValueError(
                f"unknown gate activation {self.activation!r}; valid ones are: "
                f"{', '.join(GATE_ACTIVATIONS)}"
            )
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"a gate's rank must be >= 1 (or None), got {self.rank}")
        if self.per_key and self.per_channel:
            raise ValueError("a gate is per_key or per_channel, not both")

    def activate(self, g: Tensor) -> Tensor:
        """The gate's values from its projection: ``activation`` of g."""
        if self.activation == "sigmoid":
            return g.sigmoid()
        if self.activation == "logsigmoid":
            return nn.functional.logsigmoid(g)
        if self.activation == "silu":
            return nn.functional.silu(g)
        return g


REGISTRY: dict[str, type[AttentionKernel]] = {}  # name -> class, filled as classes are defined


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class AttentionKernel(nn.Module):
    """Base class of the kernels. Subclasses implement ``weights`` and
    ``reference_weights`` (and ``forward`` where a path faster than ``weights @ v``
    exists), and set the class attributes below.

    A subclass that sets ``name`` in its own body is registered under it; a helper base
    class that sets none, or a subclass defined with ``register=False`` (a variant built
    for a test), is not.

    Args:
        head_dim: D, the size of one head (kernels with parameters size them by it): the
            width of its values, and of its queries and keys unless the kernel sets
            ``qk_dim``.
        n_head: H, the number of heads the kernel serves.
        dropout: probability of dropping attention weights during training.

    ``qk_dim`` is the width of the queries and keys the kernel takes, ``head_dim`` unless
    a kernel sets another in its ``__init__`` (Based's ``feature_dim``): the layer projects
    q and k to it, and v to ``head_dim``.

    ``keys_per_token`` is how many keys and values the kernel takes a token, 1 unless a
    kernel sets another in its ``__init__`` (Gated DeltaProduct's n_h): k and v are then
    (B, H, N n, D), token t's keys at n t .. n t + n - 1, and the padding mask stays one
    a token, (B, N). The layer projects them n times as wide, and ``weights`` is
    (B, H, Nq, N n), so that ``forward == weights @ v`` still holds.
    """

    name: ClassVar[str] = "kernel"
    formula: ClassVar[str] = ""  # the weights, in one line (the README's kernel table)
    normalized: ClassVar[bool] = True  # every row of weights() sums to 1 (or is all zero)
    # decoding keeps a state whose size does not grow with n (was ``linear``)
    constant_state: ClassVar[bool] = False
    forms_scores: ClassVar[bool] = False  # adds score_bias to its q-k scores (ALiBi): opt in
    causal_only: ClassVar[bool] = False  # reads the sequence in order: no encoder, no cross
    # takes keys of norm 1, as its layer's qk_norm gives them (the delta rule: its state stays
    # bounded where beta |k|^2 <= 2); the check and the benchmarks draw its keys so
    unit_keys: ClassVar[bool] = False
    # the options that tell one setting of the kernel from another in a record's name
    # (``fastmax(p=1)``: ``models.common.layer_names``)
    labelled: ClassVar[tuple[str, ...]] = ()
    # the fused kernels for its math that ``attention.backend`` may name (attention.backends)
    fused_backends: ClassVar[tuple[str, ...]] = ()
    # per-token, per-head inputs projected from the layer's input (``GateInput``), passed to
    # ``forward`` and ``decode`` as keyword arguments of these names
    gate_inputs: ClassVar[dict[str, GateInput]] = {}

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = takes_backend(cls.__dict__["__init__"])  # type: ignore[method-assign]
        if "linear" in cls.__dict__ and "constant_state" not in cls.__dict__:  # the old name
            cls.constant_state = bool(cls.__dict__["linear"])
            log.warning(
                "note: %s sets linear; the kernel contract now calls it constant_state "
                "(rename the class attribute)",
                cls.__name__,
            )
        name = cls.__dict__.get("name")
        if not register or name is None:
            return
        earlier = REGISTRY.get(name)
        if earlier is not None and qualified_name(earlier) != qualified_name(cls):
            raise TypeError(
                f"the attention kernel name {name!r} is taken by {qualified_name(earlier)}; "
                f"give {qualified_name(cls)} another name"
            )
        REGISTRY[name] = cls

    def __init__(self, head_dim: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if not (isinstance(head_dim, int) and head_dim > 0):
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if not (isinstance(n_head, int) and n_head > 0):
            raise ValueError(f"n_head must be a positive int, got {n_head!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.head_dim = head_dim
        self.qk_dim = head_dim
        self.keys_per_token = 1
        self.n_head = n_head
        self.dropout = dropout
        self.alibi = False

    def use_alibi(self) -> None:
        """Add ALiBi's head-sloped distance bias to the scores (``pos_encoding=alibi``);
        a kernel that forms no scores refuses, naming both options."""
        if not self.forms_scores:
            raise ValueError(
                f"pos_encoding=alibi adds a bias to the attention scores, which attention="
                f"{self.name} never forms (it is linear in the sequence length); use "
                "pos_encoding=rope with it, or a kernel that forms scores"
            )
        self.alibi = True
        slopes = torch.tensor(alibi_slopes(self.n_head))
        self.register_buffer("alibi_slopes", slopes, persistent=False)

    def score_bias(self, nq: int, nk: int, like: Tensor) -> Tensor | float:
        """What is added to the (scaled) scores: ALiBi's (H, Nq, Nk) bias, or 0."""
        if not self.alibi:
            return 0.0
        return alibi_bias(self.alibi_slopes.to(like.device, like.dtype), nq, nk)

    def reference_bias(self, nq: int, nk: int) -> Tensor | float:
        """``score_bias`` written naively in float64, from the slopes of the formula."""
        if not self.alibi:
            return 0.0
        slopes = alibi_slopes(self.n_head)
        bias = torch.zeros(self.n_head, nq, nk, dtype=torch.float64)
        for h in range(self.n_head):
            for i in range(nq):
                for j in range(nk):
                    bias[h, i, j] = -slopes[h] * abs(i + (nk - nq) - j)
        return bias

    def extra_repr(self) -> str:
        alibi = ", alibi=True" if self.alibi else ""
        return f"head_dim={self.head_dim}, n_head={self.n_head}, dropout={self.dropout}{alibi}"

    def forward(  # type: ignore[override]
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """``weights @ v``, with dropout on the weights in training. Kernels with a faster
        path (SDPA, the feature-map engine) override it."""
        self.check_inputs(q, k, v, key_padding_mask)
        w = self.weights(q, k, causal=causal, key_padding_mask=key_padding_mask)
        return nn.functional.dropout(w, self.dropout, self.training).to(v.dtype) @ v

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The explicit attention matrix (B, H, Nq, Nk), without dropout."""
        raise NotImplementedError

    def reference_weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """The weights by the kernel's formula, written naively in float64 (see
        ``attention.naive``), with the kernel's own parameters: the reference that
        ``forward`` and ``weights`` are checked against. Not for speed."""
        raise NotImplementedError(f"{type(self).__name__} has no reference_weights")

    def visible(
        self, nq: int, nk: int, *, causal: bool, key_padding_mask: Tensor | None, device: Any
    ) -> Tensor | None:
        """The (query, key) pairs the kernel may weigh, as ``attention_mask`` gives them
        (None: all); a kernel that sees fewer (a sliding window) narrows it. A query with
        no pair here gives an all-zero row."""
        return attention_mask(
            nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=device
        )

    def causal_refusal(self) -> str | None:
        """Why this kernel, as configured, cannot attend causally (None: it can). A
        kernel that reads the whole sequence (a max over it) must say so: the models
        refuse it where they mask causally, and the check tests it without a mask."""
        return None

    def sample_gates(
        self, batch: int, tokens: int, dtype: torch.dtype = torch.float32
    ) -> dict[str, Tensor]:
        """Gate inputs of the shapes the kernel declares (``gate_inputs``), for a call of
        the bare kernel outside its layer: each gate's activation of N(0, 1) draws."""
        return {
            name: gate.activate(
                torch.randn(
                    batch,
                    self.n_head,
                    tokens * (self.keys_per_token if gate.per_key else 1),
                    *([self.qk_dim] * gate.per_channel),
                )
            ).to(dtype)
            for name, gate in self.gate_inputs.items()
        }

    def noncausal_refusal(self) -> str | None:
        """Why this kernel cannot attend non-causally (None: it can). A ``causal_only``
        kernel reads the sequence in order (a state it decays or rewrites), and the models
        refuse it where they attend both ways (an encoder, a cross-attention)."""
        if not self.causal_only:
            return None
        return (
            f"attention={self.name} reads the sequence in order (a recurrent state it decays "
            "or rewrites), so it is causal only: use it in a GPT, or choose another kernel "
            "for an encoder or a cross-attention"
        )

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        """Numbers ``decode`` keeps per sequence after ``n`` tokens, all heads together:
        a KV cache holds every key and value (it grows with n); a linear kernel's state
        does not grow."""
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.n_head * n * (self.qk_dim + value_dim)

    def flops(self, n: int, causal: bool = True, value_dim: int | None = None) -> int:
        """Floating-point operations of one forward and backward pass over ``n`` tokens,
        one sequence, all heads: the count a run's model FLOPs and MFU add up
        (``models.gpt.GPT.flops_per_token``). A kernel that forms scores computes q . k and
        uses each score on a value, 2 (Dk + Dv) a query-key pair forward and twice that
        backward, over the pairs it sees (``pairs``): n (n + 1) / 2 causal, n^2 both ways.
        Softmax's grows with n a token; a linear kernel's (its own count) does not."""
        value_dim = self.head_dim if value_dim is None else value_dim
        per_pair = 6 * (self.qk_dim + value_dim) * self.keys_per_token
        return per_pair * self.pairs(n, causal) * self.n_head

    def pairs(self, n: int, causal: bool) -> int:
        """The query-key pairs of a sequence of ``n`` tokens that the kernel scores."""
        return n * (n + 1) // 2 if causal else n * n

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Any = None,
        *,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Any]:
        """Causal attention of T new tokens over everything seen so far.

        ``q, k, v`` hold only the new tokens, ``(B, H, T, ·)``; ``key_padding_mask`` is
        ``(B, T)`` for them. ``state`` is what the previous call returned (``None`` at the
        start). This default keeps a KV cache; fastmax overrides it with its recurrent state.
        """
        k, v, key_padding_mask = extend_cache(state, k, v, key_padding_mask)
        out = self(q, k, v, causal=True, key_padding_mask=key_padding_mask)
        return out, (k, v, key_padding_mask)

    @property
    def trimmable(self) -> bool:
        """Whether ``trim_state`` can cut this kernel's decoding state: a constant state,
        or the default KV cache (a kernel's own growing state, it cannot)."""
        return self.constant_state or type(self).decode is AttentionKernel.decode

    def trim_state(self, state: Any, keep: int) -> Any:
        """``state`` (what ``decode`` returned) holding at most its last ``keep`` tokens, to
        decode past the trained context on a sliding window: a constant state as it is, the
        default KV cache cut to its last ``keep`` keys and values. None where a kernel keeps
        a state of its own that grows: the caller then re-encodes its window."""
        if self.constant_state or state is None:
            return state
        if not self.trimmable:
            return None
        k, v, pad = state
        first = max(k.shape[2] - keep, 0)  # keep=0 keeps nothing (a slice -0: keeps all)
        return k[:, :, first:], v[:, :, first:], None if pad is None else pad[:, first:]

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Memory:
        """Prepare keys (B, H, Nk, D) and values for ``read_memory``."""
        return Memory(k, v, key_padding_mask)

    def read_memory(self, q: Tensor, memory: Memory) -> Tensor:
        """Non-causal attention of q (B, H, Nq, D) over a prepared memory."""
        return self(q, memory.keys, memory.values, key_padding_mask=memory.key_padding_mask)

    def check_inputs(
        self, q: Tensor, k: Tensor, v: Tensor | None, key_padding_mask: Tensor | None
    ) -> None:
        """Raise a ValueError that names the offending shapes when inputs break the contract."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is not None and t.dim() != 4:
                raise ValueError(
                    f"{self.name}: {name} must be 4-D (batch, heads, tokens, head_dim), "
                    f"got shape {tuple(t.shape)}"
                )
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"{self.name}: query head dim {q.shape[-1]} != key head dim {k.shape[-1]}; "
                "q and k must share the last dimension"
            )
        if q.shape[-1] != self.qk_dim or q.shape[1] != self.n_head:
            dim = "head_dim" if self.qk_dim == self.head_dim else "qk_dim"
            raise ValueError(
                f"{self.name}: kernel was built for {dim}={self.qk_dim}, "
                f"n_head={self.n_head} but got q of shape {tuple(q.shape)} "
                f"(batch, heads, tokens, {dim})"
            )
        if k.shape[2] == 0:
            raise ValueError(f"{self.name}: got no keys (k of shape {tuple(k.shape)})")
        if q.shape[:2] != k.shape[:2]:
            raise ValueError(
                f"{self.name}: q and k disagree on (batch, heads): "
                f"{tuple(q.shape[:2])} vs {tuple(k.shape[:2])}"
            )
        if v is not None and (v.shape[:2] != k.shape[:2] or v.shape[2] != k.shape[2]):
            raise ValueError(
                f"{self.name}: v of shape {tuple(v.shape)} does not match k of shape "
                f"{tuple(k.shape)} in (batch, heads, keys)"
            )
        if k.shape[2] % self.keys_per_token:
            n = self.keys_per_token
            raise ValueError(
                f"{self.name}: takes {n} keys a token, so k's tokens axis must be a multiple "
                f"of {n}, got k of shape {tuple(k.shape)}"
            )
        if key_padding_mask is not None:
            expected = (k.shape[0], k.shape[2] // self.keys_per_token)
            if key_padding_mask.dtype != torch.bool:
                raise ValueError(
                    f"{self.name}: key_padding_mask must be a bool tensor (True = padding), "
                    f"got dtype {key_padding_mask.dtype}; convert it with `mask.bool()`"
                )
            if tuple(key_padding_mask.shape) != expected:
                raise ValueError(
                    f"{self.name}: key_padding_mask must have shape (batch, keys) = {expected}, "
                    f"got {tuple(key_padding_mask.shape)}"
                )


AttentionKernel.__init__ = takes_backend(AttentionKernel.__init__)  # type: ignore[method-assign]


def extend_cache(
    cache: tuple[Tensor, Tensor, Tensor | None] | None,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A KV cache (keys, values, padding mask or None; None: empty) with the new tokens'
    keys, values and padding after it."""
    if cache is None:
        return k, v, key_padding_mask
    k_past, v_past, pad_past = cache
    if pad_past is not None or key_padding_mask is not None:
        pad_past = _or_zeros(pad_past, k_past)
        key_padding_mask = torch.cat([pad_past, _or_zeros(key_padding_mask, k)], dim=1)
    return torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2), key_padding_mask


def _or_zeros(mask: Tensor | None, k: Tensor) -> Tensor:
    """The padding mask for the keys ``k``, all False when ``mask`` is None."""
    if mask is not None:
        return mask
    return torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
