"""The module every linear kernel is: ``FeatureKernel``.

A linear kernel maps queries and keys to features u (``features``) and weighs key j for
query i by ``f(u_q_i . u_k_j)``, normalised over the keys, with f the polynomial of order
``p`` (``features.poly``): for fastmax and Based p = 1 or 2, whose monomials the engine
expands itself; for kernels that compute their features outright (elu + 1, random
features) p = 0 and f(x) = x. Every path then runs on the feature-map engine: the N x N
reference (``quadratic``), the non-causal state (``factorized``), the chunked causal form
(``chunked``) and the recurrent step (``recurrent``). A subclass gives ``features``,
``feature_count`` and its ``reference_weights``; the rest is here, the engine's options
too: a kernel names only its own and passes the engine's on (``FeatureKernel``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from transformers_lab.attention.backends import check_backend, choose, compute_dtype, settle
from transformers_lab.attention.base import AttentionKernel, Memory
from transformers_lab.attention.feature_map.chunked import chunked_causal
from transformers_lab.attention.feature_map.factorized import factorized
from transformers_lab.attention.feature_map.features import (
    feature_dim,
    read_state,
    safe_divide,
    weighted_state,
)
from transformers_lab.attention.feature_map.quadratic import polynomial_matrix, quadratic
from transformers_lab.attention.feature_map.recurrent import recurrent_step
from transformers_lab.attention.fla_ops import fla_polynomial, polynomial_refusal
from transformers_lab.attention.flex_ops import flex_polynomial
from transformers_lab.attention.flex_ops import refusal as flex_refusal
from transformers_lab.attention.masks import attention_mask
from transformers_lab.attention.triton_ops import refusal as triton_refusal
from transformers_lab.attention.triton_ops import triton_fastmax

log = logging.getLogger(__name__)

# the kernel classes that have said their quadratic path runs uncompiled (once a class)
UNCOMPILED_SAID: set[type] = set()


def normalise_output(out_aug: Tensor) -> Tensor:
    """Split [numerator, denominator] and divide; a query that saw no key gives zeros."""
    return safe_divide(out_aug[..., :-1], out_aug[..., -1:])


ENGINE = "engine"  # a kernel's ``**engine``: the engine's options, passed on (FeatureKernel)


def takes_engine(init: Callable[..., None]) -> bool:
    """Whether a kernel's ``__init__`` passes the engine's options on as ``**engine``."""
    param = inspect.signature(init).parameters.get(ENGINE)
    return param is not None and param.kind is param.VAR_KEYWORD


def engine_signature(init: Callable[..., None]) -> inspect.Signature:
    """``init``'s signature with its ``**engine`` spelled out: the options of
    ``FeatureKernel.__init__`` after ``*`` but ``p`` (which each kernel sets), keyword only,
    with their defaults there."""
    own = inspect.signature(init)
    engine = [
        param
        for name, param in inspect.signature(FeatureKernel.__init__).parameters.items()
        if param.kind is param.KEYWORD_ONLY and name != "p"
    ]
    kept = [param for name, param in own.parameters.items() if name != ENGINE]
    return own.replace(parameters=[*kept, *engine])


class FeatureKernel(AttentionKernel):
    """Base of the linear kernels (see the module docstring).

    A kernel names its own options in its ``__init__`` and passes the engine's on as
    ``**engine``::

        def __init__(self, head_dim, n_head, dropout=0.0, max_len=1024, **engine):
            super().__init__(head_dim, n_head, dropout, p=0, **engine)

    Its signature, which the configs are checked against (the preflight, the tests of
    ``conf/attention``) and ``help()`` shows, then lists them after its own:
    ``chunk_size``, ``impl``, ``compiled`` and ``backend``, keyword only, with the defaults
    below (``engine_signature``).

    Args:
        p: the order of the polynomial of the feature dot product (0: f(x) = x).
        chunk_size: C, the tokens processed at once by the linear paths.
        impl: ``"linear"`` (factorized / chunked), ``"quadratic"`` (the N x N reference)
            or ``"auto"``: quadratic while the keys are no more than the feature
            dimension, where the N x N form is the cheaper, linear beyond. Both give the
            same result; incremental decoding always uses the recurrent state.
        compiled: each chunk step of the linear paths through ``torch.compile``
            (``feature_map/steps.py``): the same results, 1.6-2.0x faster for fastmax p=2 at
            N=4096-16384 on one CPU thread, after a compile of 10-20 s a shape on first use.
        dropout: drops whole keys. During training each (batch, head, key) is kept with
            probability 1 - dropout and its value scaled by 1 / (1 - dropout); the
            normaliser is unchanged, so, as with dropout on an attention matrix, the
            expected output is unchanged. Dropping single (query, key) weights would need
            the N x N matrix that the linear paths never build.
        backend: what runs the training forward (``attention.backends``): ``auto`` (fla's
            kernel on CUDA where installed, our paths elsewhere), ``loop`` (our paths),
            ``fla`` (its op for the kernel's polynomial, ``fla_ops``: causal
            self-attention; other calls run our paths) or, for a polynomial of order 1 or
            2, ``flex`` (FlexAttention, ``flex_ops``: every call but decoding).

    Under autocast (fp16 / bf16) the states are accumulated in float32.
    """

    constant_state = True
    positional: ClassVar[bool] = False  # features depend on positions (``place``)
    pools_queries = False  # a query's features depend on the other queries (a max over them)
    IMPLS: ClassVar[tuple[str, ...]] = ("auto", "linear", "quadratic")
    fused_backends: ClassVar[tuple[str, ...]] = ("fla",)  # the order-1 and -2 kernels: flex too

    def __init_subclass__(cls, **kwargs: Any) -> None:
        init = cls.__dict__.get("__init__")
        if init is not None and takes_engine(init):  # before AttentionKernel reads it
            init.__signature__ = engine_signature(init)
        super().__init_subclass__(**kwargs)

    def __init__(
        self,
        head_dim: int,
        n_head: int,
        dropout: float = 0.0,
        *,
        p: int,
        chunk_size: int = 128,
        impl: str = "auto",
        compiled: bool = False,
        backend: str | None = "auto",
    ) -> None:
        super().__init__(head_dim, n_head, dropout)
        self.backend = check_backend(self.name, backend, self.fused_backends)
        if chunk_size < 1:
            raise ValueError(f"{self.name}: chunk_size must be >= 1, got {chunk_size}")
        if impl not in self.IMPLS:
            raise ValueError(f"{self.name}: unknown impl {impl!r}; choose one of {self.IMPLS}")
        self.p = p
        self.chunk_size = chunk_size
        self.impl = impl
        self.compiled = bool(compiled)

    # ------------------------------------------------------------ what a subclass gives

    @property
    def feature_count(self) -> int:
        """The size of ``features``' output (the engine expands it by ``p``)."""
        return self.qk_dim

    def features(self, x: Tensor, role: str) -> Tensor:
        """Queries (``role="q"``) or keys (``"k"``), (B, H, N, D), as the engine's u."""
        return x

    def place(self, u: Tensor, start: int) -> Tensor:
        """Features of the tokens at positions ``start ..`` (a ``positional`` kernel's,
        cosFormer's re-weighting); as they are here."""
        return u

    # ------------------------------------------------------------ the paths

    def path(self, num_keys: int) -> str:
        """The implementation ``forward`` takes for ``num_keys`` keys."""
        if self.impl != "auto":
            return self.impl
        return "quadratic" if num_keys <= feature_dim(self.feature_count, self.p) else "linear"

    def say_uncompiled(self, num_keys: int) -> None:
        """Say, once for this kernel class, that ``compiled=True`` compiles nothing where
        the quadratic path runs: only the linear paths' steps are compiled, and
        ``impl=auto`` takes the quadratic one for few keys, so a short run compiles nothing
        and is no faster."""
        if type(self) in UNCOMPILED_SAID or torch.compiler.is_compiling():
            return  # said, or inside the model's torch.compile, which compiles this path too
        UNCOMPILED_SAID.add(type(self))
        features = feature_dim(self.feature_count, self.p)
        why = (
            f"impl=auto takes it while the keys are no more than its {features} features"
            if self.impl == "auto"
            else "impl=quadratic"
        )
        log.warning(
            "attention.compiled=true: %s runs uncompiled at %d keys, on its quadratic path "
            "(%s); only the linear path is compiled: attention.impl=linear forces it",
            self.name,
            num_keys,
            why,
        )

    def extra_repr(self) -> str:
        compiled = ", compiled=True" if self.compiled else ""
        backend = "" if self.backend == "auto" else f", backend={self.backend}"
        return (
            f"{super().extra_repr()}, chunk_size={self.chunk_size}, impl={self.impl}{compiled}"
            f"{backend}"
        )

    def fused(self, q: Tensor, k: Tensor, causal: bool) -> str | None:
        """The fused kernel this call takes (None: our paths): fla's and ours (``triton``)
        cover causal self-attention, FlexAttention every call."""
        fused = choose(self.backend, self.fused_backends, q.device)
        if fused in ("fla", "triton") and not (causal and q.shape[2] == k.shape[2]):
            return None
        why = None
        if fused == "fla":
            why = polynomial_refusal(self.p, self.feature_count)
        elif fused == "triton":
            why = triton_refusal(self.feature_count) if self.p == 2 else "it is a kernel for p=2"
        elif fused == "flex":
            why = flex_refusal(self.feature_count, self.head_dim, q.device)
        return settle(self.name, self.backend, fused, why)

    def fused_forward(
        self, fused: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, pad: Tensor | None
    ) -> Tensor:
        """``forward`` by the fused kernel ``fused``, in autocast's dtype: our features,
        dropped and padded keys as ``prepare`` gives them."""
        dtype = compute_dtype(v)
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, _ = self.prepare(q, k, None, pad, k.shape[2] - q.shape[2] if causal else 0)
            qs, ks, vd = (t.to(dtype) for t in (qs, ks, self.drop_keys(v)))
            keep = None if pad is None else ~pad
            if fused == "fla":
                out = fla_polynomial(qs, ks, vd, self.p, keep)
            elif fused == "triton":
                out, _ = triton_fastmax(qs, ks, vd, keep)
            else:
                out = flex_polynomial(qs, ks, vd, self.p, causal=causal, key_padding_mask=pad)
            return out.to(v.dtype)

    def prepare(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor | None,
        key_padding_mask: Tensor | None,
        q_start: int = 0,
        k_start: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Features of q and k (at positions ``q_start ..`` and ``k_start ..``), and
        v_aug = [v, 1] with dropped and padded keys zeroed.

        Low-precision inputs are promoted to float32, where the states accumulate.
        """
        if q.dtype in (torch.float16, torch.bfloat16):
            q, k = q.float(), k.float()
            v = None if v is None else v.float()
        pad = None if key_padding_mask is None else key_padding_mask[:, None, :, None]
        if pad is not None:  # padding is zero before the features too (a max over tokens)
            k = k.masked_fill(pad, 0.0)
            if self.pools_queries and q.shape[-2] == k.shape[-2]:  # self-attention
                q = q.masked_fill(pad, 0.0)  # the padded queries count not either
        q, k = self.features(q, "q"), self.features(k, "k")
        if self.positional:
            q, k = self.place(q, q_start), self.place(k, k_start)
        if pad is not None:
            k = k.masked_fill(pad, 0.0)
        if v is None:
            return q, k, None
        v = self.drop_keys(v)
        v_aug = torch.cat([v, v.new_ones(*v.shape[:3], 1)], dim=-1)  # (B, H, Nk, Dv + 1)
        if pad is not None:
            v_aug = v_aug.masked_fill(pad, 0.0)
        return q, k, v_aug

    def drop_keys(self, v: Tensor) -> Tensor:
        """The values with whole keys dropped while training (``dropout``, the class doc)."""
        if not (self.training and self.dropout > 0):
            return v
        keep = torch.rand(*v.shape[:3], 1, device=v.device) >= self.dropout
        return v * keep.to(v.dtype) / (1.0 - self.dropout)

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
        if fused := self.fused(q, k, causal):
            return self.fused_forward(fused, q, k, v, causal, key_padding_mask)
        q_start = k.shape[2] - q.shape[2] if causal else 0  # queries end with the keys
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, v_aug = self.prepare(q, k, v, key_padding_mask, q_start)
            if self.path(k.shape[2]) == "quadratic":
                if self.compiled:
                    self.say_uncompiled(k.shape[2])
                out = quadratic(qs, ks, v_aug, self.p, causal)
            elif causal:
                out, _ = chunked_causal(
                    qs, ks, v_aug, self.p, self.chunk_size, compiled=self.compiled
                )
            else:
                out = factorized(qs, ks, v_aug, self.p, self.chunk_size, self.compiled)
            return normalise_output(out).to(v.dtype)

    def weights(
        self,
        q: Tensor,
        k: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        self.check_inputs(q, k, None, key_padding_mask)
        q_start = k.shape[2] - q.shape[2] if causal else 0
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, _ = self.prepare(q, k, None, key_padding_mask, q_start)
            allowed = attention_mask(
                q.shape[2],
                k.shape[2],
                causal=causal,
                key_padding_mask=key_padding_mask,
                device=q.device,
            )
            a = polynomial_matrix(qs, ks, self.p, allowed)  # (B, H, Nq, Nk)
            return safe_divide(a, a.sum(dim=-1, keepdim=True)).to(q.dtype)

    def state_size(self, n: int, value_dim: int | None = None) -> int:
        """The recurrent state ``sum_j [v_j, 1] phi(k_j)^T``: H (Dv + 1) F, whatever n."""
        value_dim = self.head_dim if value_dim is None else value_dim
        return self.n_head * (value_dim + 1) * feature_dim(self.feature_count, self.p)

    def feature_flops(self) -> int:
        """Matmul FLOPs of ``features`` per token and head, queries and keys, forward and
        backward (a learned or random projection); none here."""
        return 0

    def matmul_flops(self, n: int, causal: bool, value_dim: int | None = None) -> int:
        """Floating-point operations of the matrix products of one forward and backward
        pass of the linear path over ``n`` tokens, all heads, one sequence: the work that
        bounds its time at a machine's matmul rate. With F features, u of size E, Dv + 1
        value columns and chunks of C, per token and head:

        - every path: the state's update and read, and the backward's four products of
          the same size, 12 F (Dv + 1), and ``feature_flops``;
        - causal, also the C x C blocks: the scores and their use, 2 C (E + Dv + 1)
          forward and 2 C (3 E + 2 (Dv + 1)) backward, whole blocks as computed.

        Tokens are counted as the paths pad them, to whole chunks. The feature maps'
        elementwise work is not counted. ``tests/attention/test_fastmax_paths.py`` checks this
        count against torch's FLOP counter.
        """
        dv1 = (self.head_dim if value_dim is None else value_dim) + 1
        f, e = feature_dim(self.feature_count, self.p), self.feature_count
        c = min(self.chunk_size, n)
        padded = -(-n // c) * c
        per_token = 12 * f * dv1 + (2 * c * (4 * e + 3 * dv1) if causal else 0)
        return (per_token * padded + self.feature_flops() * n) * self.n_head

    def flops(self, n: int, causal: bool = True, value_dim: int | None = None) -> int:
        """Its ``matmul_flops``: the same for every n a token, chunks aside."""
        return self.matmul_flops(n, causal, value_dim)

    def memory(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None = None) -> Memory:
        """The factorised state of every key: reading it costs O(1) in the memory length."""
        self.check_inputs(k[:, :, :1], k, v, key_padding_mask)
        with torch.autocast(k.device.type, enabled=False):
            _, ks, v_aug = self.prepare(k[:, :, :1], k, v, key_padding_mask)
            return Memory(state=weighted_state(v_aug, ks, self.p))

    def read_memory(self, q: Tensor, memory: Memory) -> Tensor:
        if memory.state is None:
            raise ValueError(f"{self.name}.read_memory needs a memory made by its memory()")
        with torch.autocast(q.device.type, enabled=False):
            qs, _, _ = self.prepare(q, q, None, None)
            return normalise_output(read_state(qs, memory.state, self.p)).to(q.dtype)

    def decode(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Causal attention of T new tokens given the recurrent state of the past ones.

        The state is ``sum_j [v_j, 1] phi(k_j)^T`` over the keys seen so far, shape
        (B, H, Dv + 1, F): its size, and the work per new token, do not grow with the
        context.
        """
        self.check_inputs(q, k, v, key_padding_mask)
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"{self.name}.decode: q and k must hold the same new tokens, got "
                f"{q.shape[2]} queries and {k.shape[2]} keys"
            )
        seen = 0
        if self.positional:  # the state also counts the tokens seen: the new ones follow
            state, seen = (None, 0) if state is None else state
        with torch.autocast(q.device.type, enabled=False):
            qs, ks, v_aug = self.prepare(q, k, v, key_padding_mask, seen, seen)
            if q.shape[2] == 1:
                out, state = recurrent_step(qs, ks, v_aug, self.p, state)
            elif self.backend == "triton":  # a prefill of T tokens: the kernel takes the state
                keep = v_aug[..., -1] != 0  # a padded key's 1 is zero
                out, state = triton_fastmax(qs, ks, v_aug[..., :-1], keep, state, want_state=True)
                return out.to(v.dtype), state
            else:
                out, state = chunked_causal(
                    qs, ks, v_aug, self.p, self.chunk_size, state, self.compiled
                )
            out = normalise_output(out).to(v.dtype)
            return (out, (state, seen + q.shape[2])) if self.positional else (out, state)
