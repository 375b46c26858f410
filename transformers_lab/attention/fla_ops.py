"""fla's Triton kernels for our kernels' math: ``attention.backend=fla`` (``backends``).

flash-linear-attention's ops (``fla-core``: ``pip install -e '.[gpu]'``) compute, for
causal self-attention, what our loops compute:

| our kernel                                   | fla's op                                  |
|----------------------------------------------|-------------------------------------------|
| features u, f(x) = x (linear, Performer,     | ``chunk_linear_attn(u_q, u_k, v,          |
| cosFormer)                                   | normalize=True)``                          |
| f(x) = 1 + x (fastmax p=1)                   | the same on [1, u_q], [1, u_k]            |
| f(x) = 1 + x + x^2 / 2 (fastmax p=2, Based)  | ``fused_chunk_based`` (q and k at most 16 |
|                                              | wide) or ``parallel_based`` (up to 128)   |
| decay one number a head (B, H, N)            | ``chunk_simple_gla`` (``g``)              |
| decay one number a key channel               | ``chunk_gla`` (``g``)                     |
| the delta rule, no decay                     | ``chunk_delta_rule``                      |
| the delta rule, decay a head                 | ``chunk_gated_delta_rule``                |
| the delta rule, decay a key channel (KDA)    | ``chunk_kda``                             |
| n_h delta-rule steps a token, decay a head   | ``chunk_gated_delta_product``             |
| (Gated DeltaProduct)                         |                                           |
| the DPLR transition, decay a key channel     | ``chunk_dplr_delta_rule`` (the op under   |
| (RWKV-7)                                     | ``chunk_rwkv7``)                          |
| softmax with a forget gate (FoX)             | ``parallel_forgetting_attn``              |

Each op takes our features (scale folded into the queries), log decay and rate in fla's
layout (B, N, H, D) where ours is (B, H, N, D). A padded key is zeroed as our loop zeroes
it; the polynomial of order 2 gives a zeroed key the weight 1, so with padding it runs on
[v, 1, 0...] unnormalised and divides as our loop does. tests/attention/test_fla_ops.py holds
each op equal to our loop in float32, outputs and gradients, under Triton's interpreter on
the CPU; tests/gpu in bf16 on a GPU. Decoding stays on our recurrence (one token: O(1)
work, no kernel to launch but a few products).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

from transformers_lab.attention.backends import check_device

# fla's delta rule (``chunk_delta_rule``) asserts q is not float32: refused in our words
# first. The tests lift both, under Triton's interpreter, to check it in float32.
DELTA_RULE_HALF_ONLY = True


def fla_layout(t: Tensor) -> Tensor:
    """(B, H, N, ...) -> fla's (B, N, H, ...), contiguous."""
    return t.transpose(1, 2).contiguous()


def refuses(
    dtype: torch.dtype, log_decay: Tensor | None, beta: Tensor | None, keys_per_token: int = 1
) -> bool:
    """fla's op for this form refuses ``dtype`` (its delta rule without a decay, and its
    delta product, in float32):
    ``auto`` then takes our loop, an explicit ``fla`` says so (``fla_recurrence``)."""
    return (
        DELTA_RULE_HALF_ONLY
        and beta is not None
        and (log_decay is None or keys_per_token > 1)
        and dtype == torch.float32
    )


def fla_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None = None,
    beta: Tensor | None = None,
    *,
    scale: float,
    keys_per_token: int = 1,
) -> Tensor:
    """``gated.chunked_recurrence``'s output o (B, H, N, Dv), from zero state, by fla's op
    for its form (the module doc's table), in q's dtype (the delta rule: bf16 or fp16).

    With n = ``keys_per_token`` > 1 (Gated DeltaProduct), the inputs are the recurrence's
    one step a key (``GatedKernel.steps``): each query after its token's last key, the
    decay at its token's first; fla's op takes one query and decay a token, and o is one
    output a token, (B, H, N / n, Dv)."""
    check_device(q, "fla")
    if refuses(q.dtype, log_decay, beta, keys_per_token):  # fla asserts it, in no words of ours
        raise ValueError(
            "attention.backend=fla: fla's delta rule runs in bf16 or fp16 only; train with "
            "trainer.precision=bf16-mixed (trainer=gpu does) or use attention.backend=loop"
        )
    ops = importlib.import_module("fla.ops")
    dv = v.shape[-1]
    n = keys_per_token
    if n > 1:
        if beta is None or (log_decay is not None and log_decay.dim() == 4):
            raise ValueError(
                "attention.backend=fla: fla's op for several keys a token is the delta rule "
                "with a decay a head (chunk_gated_delta_product); use attention.backend=loop"
            )
        q = q[:, :, n - 1 :: n]  # the queries after each token's last key
        log_decay = None if log_decay is None else log_decay[:, :, ::n]  # at its first
    # even widths (fla's 16-bit backward); a zero key channel writes and reads nothing
    q, k, v = fla_layout(even(q)), fla_layout(even(k)), fla_layout(even(v))
    if log_decay is not None and log_decay.dim() == 4:
        log_decay = even(log_decay)  # the zero channel's decay: none
    g = None if log_decay is None else fla_layout(log_decay.float())
    if beta is None:
        if g is None:
            o, _ = ops.linear_attn.chunk_linear_attn(q, k, v, scale=scale, normalize=False)
        elif g.dim() == 3:
            o, _ = ops.simple_gla.chunk_simple_gla(q, k, v, g=g, scale=scale)
        else:
            o, _ = ops.gla.chunk_gla(q, k, v, g=g, scale=scale)
    else:
        beta = fla_layout(beta)
        if n > 1:
            o, _ = ops.gated_delta_product.chunk_gated_delta_product(
                q, k, v, g=g, beta=beta, scale=scale, num_householder=n
            )
        elif g is None:
            o, _ = ops.delta_rule.chunk_delta_rule(q, k, v, beta=beta, scale=scale)
        elif g.dim() == 3:
            o, _ = ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=scale)
        else:  # a decay per key channel: KDA
            o, _ = ops.kda.chunk_kda(q, k, v, g=g, beta=beta, scale=scale)
    return o.transpose(1, 2)[..., :dv]


def polynomial_refusal(p: int, width: int) -> str | None:
    """Why fla's op for the polynomial of order ``p`` cannot take features ``width`` wide
    (None: it can)."""
    if p == 2 and width > 128:
        return f"fla's Based kernels take queries and keys at most 128 wide, got {width}"
    return None


def even(t: Tensor) -> Tensor:
    """``t`` with a zero column more where its last dim is odd: fla's backward in 16 bits
    takes even widths only, and a zero feature changes no product."""
    return torch.nn.functional.pad(t, (0, t.shape[-1] % 2))


def fla_polynomial(qs: Tensor, ks: Tensor, v: Tensor, p: int, keep: Tensor | None = None) -> Tensor:
    """Causal ``sum_j f(qs_i . ks_j) v_j / sum_j f(qs_i . ks_j)``, j <= i, with f the
    engine's polynomial of order ``p`` (``features.poly``: 0 x, 1 1 + x, 2 1 + x + x^2/2),
    by fla's op for p (the module doc's table); ``keep`` (B, N) bool, False where a key is
    padding (its features are already zero). (B, H, N, Dv), in ``qs``' dtype."""
    check_device(qs, "fla")
    if why := polynomial_refusal(p, qs.shape[-1]):
        raise ValueError(f"attention.backend=fla: {why}; use attention.backend=auto")
    ops = importlib.import_module("fla.ops")
    dv = v.shape[-1]
    if p == 2:
        based = ops.based.fused_chunk_based if qs.shape[-1] <= 16 else ops.based.parallel_based

        def based_layout(t: Tensor) -> Tensor:  # fla's Based ops turn (B, N, H, D) back to
            return t.transpose(1, 2)  # (B, H, N, D) for their kernels: a view, no copy

        if keep is None:  # fla's normaliser
            o = based(based_layout(qs), based_layout(ks), based_layout(v), scale=1.0, use_norm=True)
            return o.transpose(1, 2)
        # [v, 1, 0 ...]: fla's Based kernels take a width of a power of two
        width = 1 << dv.bit_length()  # > Dv
        v_aug = torch.cat([v, v.new_ones(*v.shape[:3], 1)], dim=-1) * keep[:, None, :, None]
        v_aug = torch.nn.functional.pad(v_aug, (0, width - v_aug.shape[-1]))
        o = based(based_layout(qs), based_layout(ks), based_layout(v_aug), scale=1.0,
                  use_norm=False)  # fmt: skip
        o = o.transpose(1, 2)
        den = o[..., dv : dv + 1]
        return o[..., :dv] / den.masked_fill(den == 0, 1.0)
    if p == 1:  # 1 + x = [1, u_q] . [1, u_k]; a padded key's 1 is zero too
        one_k = ks.new_ones(*ks.shape[:3], 1)
        if keep is not None:
            one_k = one_k * keep[:, None, :, None]
        qs = torch.cat([qs.new_ones(*qs.shape[:3], 1), qs], dim=-1)
        ks = torch.cat([one_k, ks], dim=-1)
    elif p != 0:
        raise ValueError(f"fla covers the polynomials of order 0, 1 and 2, got p={p}")
    o, _ = ops.linear_attn.chunk_linear_attn(
        fla_layout(even(qs)), fla_layout(even(ks)), fla_layout(even(v)), scale=1.0,
        normalize=True,
    )  # fmt: skip
    return o.transpose(1, 2)[..., :dv]


def fla_dplr(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    alpha: Tensor,
    beta: Tensor,
    *,
    scale: float,
) -> Tensor:
    """``gated.dplr.chunked_dplr``'s output o (B, H, N, Dv), from zero state, by fla's
    ``chunk_dplr_delta_rule`` (its ``a`` our alpha, ``b`` our beta, ``gk`` our log decay
    a key channel), in q's dtype. Without a bound on the decay (``lower_bound`` or
    ``safe_gate``, which license fla's faster tensor-core scheme, factored about each
    chunk's middle row: 5e-5 from our loop in float32 where this is 2e-7)."""
    check_device(q, "fla")
    ops = importlib.import_module("fla.ops")
    dv = v.shape[-1]
    # even widths (fla's 16-bit backward); a zero key channel decays, reads and writes nothing
    q, k, v, alpha, beta = (fla_layout(even(t)) for t in (q, k, v, alpha, beta))
    gk = fla_layout(even(log_decay).float())
    o, _ = ops.generalized_delta_rule.chunk_dplr_delta_rule(
        q, k, v, a=alpha, b=beta, gk=gk, scale=scale
    )
    return o.transpose(1, 2)[..., :dv]


def fla_forgetting(q: Tensor, k: Tensor, v: Tensor, log_f: Tensor, *, scale: float) -> Tensor:
    """FoX's causal softmax(scale q . k + c_i - c_j), c = cumsum(log f) (B, H, N), by fla's
    ``parallel_forgetting_attn``: (B, H, N, Dv) in q's dtype."""
    check_device(q, "fla")
    ops = importlib.import_module("fla.ops")
    o = ops.forgetting_attn.parallel_forgetting_attn(
        fla_layout(q), fla_layout(k), fla_layout(v), fla_layout(log_f.float()), scale=scale
    )
    return o.transpose(1, 2)
