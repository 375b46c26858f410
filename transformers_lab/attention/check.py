"""The kernel contract, checked on any kernel, the user's own included::

    python -m transformers_lab.attention.check fastmax p=1
    python -m transformers_lab.attention.check fastmax_p2
    python -m transformers_lab.attention.check mine --config-dir my_conf
    python -m transformers_lab.attention.check my_package.kernels.MyKernel scale=0.5
    python -m transformers_lab.attention.check my_conf/attention/mine.yaml
    python -m transformers_lab.attention.check gla --device cuda

TARGET is any name the ``attention`` group takes (the user's own with ``--config-dir DIR``
or ``hydra.searchpath=[file://DIR]``, as ``tlab-train`` takes it), a registered kernel, a
class path ``package.module.Class``, or a kernel's yaml (``attention/resolve.py``);
``key=value`` pairs are kernel options. The checks, on float64 inputs with the kernel's
learned parameters moved off their initial values:

- ``shapes``: self- and cross-attention (Nq != Nk, Dv != D) give (B, H, Nq, Dv), finite;
- ``reference``: the kernel defines ``reference_weights``, and ``forward`` equals its
  ``reference_weights @ v`` within 1e-10 (and within 1e-5 in float32), causal or not,
  padded or not;
- ``weights``: ``forward == weights @ v``, and ``weights`` equals the reference (where
  there is one: a missing reference is the ``reference`` check's failure alone);
- ``rows``: a kernel that declares ``normalized`` has rows that sum to 1, every row
  that sees a key (only a query with no key to see may give an all-zero row);
- ``alignment``: causal with Nq < Nk aligns the queries to the last Nq keys;
- ``future``: a causal output does not change when later keys and values do;
- ``padding``: padded keys and values change nothing; in self-attention, nor do padded
  queries change the other queries' outputs;
- ``masked``: a query with no key to see gives zeros and finite gradients;
- ``decode``: ``decode`` token by token, and in chunks, equals the causal ``forward``;
- ``state``: the decode state holds ``state_size(n)`` numbers, constant for a ``linear``
  kernel;
- ``memory``: ``read_memory(q, memory(k, v))`` equals the non-causal ``forward``;
- ``gradcheck``: float64 gradients of q, k, v (and the parameters) agree with finite
  differences;
- ``refusal``: a kernel whose ``causal_refusal()`` says it cannot be causal (fastmax with
  ``normalize=sequence_max``) refuses a causal call and decoding with that reason; it is
  checked without a causal mask, in place of ``alignment``, ``future``, ``decode`` and
  ``state``.

A kernel that declares gate inputs (``AttentionKernel.gate_inputs``) gets them, in the
checks above, as a fixed function of each token's key, so that every call sees the same
gates for the same token. With the layer's parts switched on (``short_conv=4``,
``output_gate=true``, ...; ``nn.parts``) or gate inputs declared, the multi-head layer
built around the kernel is checked too:

- ``layer decode``: the layer's ``decode``, token by token and in chunks, padded or not,
  equals its causal forward (the short convolution's window carried between calls);
- ``layer future``: a causal output does not change when later tokens do;
- ``layer padding``: padded tokens change no other token's output;
- ``layer state``: the decode state holds the layer's ``state_size(n)`` numbers;
- ``layer gradcheck``: float64 gradients of the input and every parameter.

``--device cuda`` runs every check on the GPU (tensors and the kernel built there, by
``torch.device`` as the default device), in float64 as on the CPU, and one more:

- ``placement``: the kernel and its layer built on the CPU and moved to the GPU, as a
  model is, run forward (and decode) on tensors made there with no default device: a
  tensor the kernel makes without ``device=`` fails here, not in a training run.

One line per failure, and exit status 1 if any; ``ok`` and exit status 0 otherwise.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from transformers_lab.attention.base import AttentionKernel, visible_keys
from transformers_lab.attention.parts import LayerParts
from transformers_lab.attention.resolve import UnknownKernel, config_dirs, kernel_config
from transformers_lab.config import CONF_DIR

B, H, D, DV = 2, 3, 8, 5
SHAPES = [(7, 7), (3, 9), (9, 4)]  # (Nq, Nk): self, fewer queries, more queries
Factory = Callable[..., AttentionKernel]


class CheckError(ValueError):
    """The target cannot be resolved or built."""


# ---------------------------------------------------------------- the target


def kernel_factory(
    target: str, options: dict[str, Any] | None = None, dirs: Sequence[Path] = (CONF_DIR,)
) -> Factory:
    """A factory ``f(head_dim=, num_heads=)`` for TARGET (a kernel yaml, an option of the
    attention group in ``dirs``, a registered name or a class path) with ``options``; the
    layer's switches (``short_conv=4``) ride in it, as in an attention config."""
    from hydra.utils import instantiate

    try:
        return instantiate(kernel_config(target, dirs, options))
    except UnknownKernel as exc:
        raise CheckError(str(exc)) from None


def with_alibi(factory: Factory) -> Factory:
    """The factory's kernels with ALiBi's bias on their scores (``use_alibi``)."""

    def build_with_alibi(**geometry: int) -> AttentionKernel:
        kernel = factory(**geometry)
        kernel.use_alibi()
        return kernel

    return build_with_alibi


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    """The module in float64 and eval mode, its parameters moved off their initial values
    (so that a reference that ignored one would be caught)."""
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return module.eval()


def build(factory: Factory) -> AttentionKernel:
    """The float64 kernel under test (the layer's parts it carries are the layer checks');
    a kernel with gate inputs gets them from its keys (``gated``)."""
    kernel = perturbed(factory(head_dim=D, num_heads=H))
    return gated(kernel) if kernel.gate_inputs else kernel


def gated(kernel: AttentionKernel) -> AttentionKernel:
    """The kernel, its gate inputs supplied at every call as a fixed function of each
    token's key (its activation of ``k @ W`` for a fixed W), so that forward, decode and
    the checks' changed keys all see the gates their tokens would have."""
    gates, d = kernel.gate_inputs, kernel.qk_dim
    weights = {
        name: torch.randn(d, d if g.per_channel else 1, dtype=torch.float64, generator=None)
        for name, g in gates.items()
    }

    def values(k: Tensor) -> dict[str, Tensor]:
        out = {}
        for name, gate in gates.items():
            g = k @ weights[name].to(k)
            out[name] = gate.activate(g if gate.per_channel else g.squeeze(-1))
        return out

    base = type(kernel)

    class Gated(base, register=False):  # type: ignore[valid-type, misc]
        def forward(self, q, k, v, **kw):  # type: ignore[no-untyped-def, override]
            return super().forward(q, k, v, **{**values(k), **kw})

        def weights(self, q, k, **kw):  # type: ignore[no-untyped-def, override]
            return super().weights(q, k, **{**values(k), **kw})

        def reference_weights(self, q, k, **kw):  # type: ignore[no-untyped-def, override]
            return super().reference_weights(q, k, **{**values(k), **kw})

        def decode(self, q, k, v, state=None, **kw):  # type: ignore[no-untyped-def, override]
            return super().decode(q, k, v, state, **{**values(k), **kw})

    Gated.__name__ = Gated.__qualname__ = base.__name__
    if base.reference_weights is AttentionKernel.reference_weights:
        Gated.reference_weights = AttentionKernel.reference_weights  # type: ignore[method-assign]
    kernel.__class__ = Gated
    return kernel


# ---------------------------------------------------------------- the checks


def qkv(
    kernel: AttentionKernel, nq: int, nk: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries and keys as wide as the kernel takes them (``qk_dim``), values DV wide."""
    d = kernel.qk_dim
    return (
        torch.randn(B, H, nq, d, dtype=dtype),
        torch.randn(B, H, nk, d, dtype=dtype),
        torch.randn(B, H, nk, DV, dtype=dtype),
    )


def padding(nk: int) -> Tensor:
    """Batch 0 unpadded, batch 1 with its last two keys padded."""
    mask = torch.zeros(B, nk, dtype=torch.bool)
    mask[1, -2:] = True
    return mask


def modes(kernel: AttentionKernel) -> tuple[bool, ...]:
    """The values of ``causal`` a kernel takes: both, or the one it does not refuse."""
    if kernel.causal_refusal():
        return (False,)
    if kernel.noncausal_refusal():
        return (True,)
    return (False, True)


def cases(kernel: AttentionKernel) -> list[tuple[int, int, bool, bool]]:
    """(Nq, Nk, causal, padded), in the modes the kernel takes (``modes``)."""
    return [
        (nq, nk, causal, padded)
        for nq, nk in SHAPES
        for causal in modes(kernel)
        for padded in (False, True)
    ]


def describe(nq: int, nk: int, causal: bool, padded: bool) -> str:
    return f"Nq={nq} Nk={nk}{' causal' if causal else ''}{' padded' if padded else ''}"


def gap(a: Tensor, b: Tensor, rtol: float, atol: float) -> str | None:
    """None when a and b agree within rtol, atol; else how far apart they are."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=False):
        return None
    diff = (a.double() - b.double()).abs().nan_to_num(torch.inf)
    return f"max abs diff {diff.max().item():.3g}"


def check_shapes(kernel: AttentionKernel) -> list[str]:
    failures = []
    for nq, nk, causal, padded in cases(kernel):
        q, k, v = qkv(kernel, nq, nk)
        out = kernel(q, k, v, causal=causal, key_padding_mask=padding(nk) if padded else None)
        if tuple(out.shape) != (B, H, nq, DV) or not torch.isfinite(out).all():
            failures.append(
                f"{describe(nq, nk, causal, padded)}: got shape {tuple(out.shape)}, finite="
                f"{bool(torch.isfinite(out).all())}; want ({B}, {H}, {nq}, {DV}), finite"
            )
    return failures


def has_reference(kernel: AttentionKernel) -> bool:
    """Whether the kernel's class defines ``reference_weights`` (the base class has none)."""
    return type(kernel).reference_weights is not AttentionKernel.reference_weights


def check_reference(kernel: AttentionKernel) -> list[str]:
    if not has_reference(kernel):
        return [
            f"{type(kernel).__name__} defines no reference_weights: write the weights from "
            "the kernel's formula, naively in float64 (attention.naive has the masks and the "
            "row sums); forward and weights are held against it"
        ]
    failures = []
    kernel32 = copy.deepcopy(kernel).float()
    for nq, nk, causal, padded in cases(kernel):
        q, k, v = qkv(kernel, nq, nk)
        mask = padding(nk) if padded else None
        want = kernel.reference_weights(q, k, causal=causal, key_padding_mask=mask) @ v
        out = kernel(q, k, v, causal=causal, key_padding_mask=mask)
        if (why := gap(out, want, 1e-10, 1e-12)) is not None:
            failures.append(f"{describe(nq, nk, causal, padded)}, float64: {why} (want 1e-10)")
        out32 = kernel32(q.float(), k.float(), v.float(), causal=causal, key_padding_mask=mask)
        if (why := gap(out32, want, 1e-5, 1e-5)) is not None:
            failures.append(f"{describe(nq, nk, causal, padded)}, float32: {why} (want 1e-5)")
    return failures


def check_weights(kernel: AttentionKernel) -> list[str]:
    failures = []
    for nq, nk, causal, padded in cases(kernel):
        q, k, v = qkv(kernel, nq, nk)
        mask = padding(nk) if padded else None
        w = kernel.weights(q, k, causal=causal, key_padding_mask=mask)
        if has_reference(kernel):
            ref = kernel.reference_weights(q, k, causal=causal, key_padding_mask=mask)
            if (why := gap(w, ref, 1e-10, 1e-12)) is not None:
                failures.append(f"{describe(nq, nk, causal, padded)}: weights != reference, {why}")
        out = kernel(q, k, v, causal=causal, key_padding_mask=mask)
        if (why := gap(out, w @ v, 1e-10, 1e-12)) is not None:
            failures.append(f"{describe(nq, nk, causal, padded)}: forward != weights @ v, {why}")
    return failures


def check_rows(kernel: AttentionKernel) -> list[str]:
    if not type(kernel).normalized:
        return []
    failures = []
    for nq, nk, causal, padded in cases(kernel):
        q, k, _ = qkv(kernel, nq, nk)
        mask = padding(nk) if padded else None
        w = kernel.weights(q, k, causal=causal, key_padding_mask=mask)
        allowed = kernel.visible(nq, nk, causal=causal, key_padding_mask=mask, device=w.device)
        sees = (visible_keys(allowed, nq, nk, w.device) > 0).squeeze(-1).expand(w.shape[:-1])
        sums = w.sum(-1)[sees]  # the rows of queries with a key to see; the others are zero
        if not torch.allclose(sums, torch.ones_like(sums), atol=1e-10):
            worst = (sums - 1).abs().max().item()
            failures.append(
                f"{describe(nq, nk, causal, padded)}: a row of a query that sees a key sums "
                f"to 1 {worst:+.3g} although the kernel declares normalized = True"
            )
    return failures


def check_alignment(kernel: AttentionKernel) -> list[str]:
    q, k, v = qkv(kernel, 9, 9)
    full = kernel(q, k, v, causal=True)
    last = kernel(q[:, :, -3:], k, v, causal=True)
    why = gap(last, full[:, :, -3:], 1e-10, 1e-12)
    return [] if why is None else [f"Nq=3 Nk=9 causal: not the last 3 rows of Nq=Nk=9, {why}"]


def check_future(kernel: AttentionKernel) -> list[str]:
    q, k, v = qkv(kernel, 9, 9)
    out = kernel(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5:] += torch.randn_like(k2[:, :, 5:])
    v2[:, :, 5:] += torch.randn_like(v2[:, :, 5:])
    changed = kernel(q, k2, v2, causal=True)
    why = gap(changed[:, :, :5], out[:, :, :5], 1e-10, 1e-12)
    return [] if why is None else [f"outputs 0..4 change with keys 5..8 (a leak), {why}"]


def check_padding(kernel: AttentionKernel) -> list[str]:
    failures = []
    for causal in modes(kernel):
        q, k, v = qkv(kernel, 7, 7)
        mask = padding(7)
        out = kernel(q, k, v, causal=causal, key_padding_mask=mask)
        k2, v2 = k.clone(), v.clone()
        k2[1, :, -2:] = 100 * torch.randn_like(k2[1, :, -2:])
        v2[1, :, -2:] = 100 * torch.randn_like(v2[1, :, -2:])
        changed = kernel(q, k2, v2, causal=causal, key_padding_mask=mask)
        if (why := gap(changed, out, 1e-10, 1e-12)) is not None:
            failures.append(f"{'causal: ' if causal else ''}padded keys change the output, {why}")
        q2 = q.clone()  # self-attention: the padded positions are padded queries too
        q2[1, :, -2:] = 100 * torch.randn_like(q2[1, :, -2:])
        changed = kernel(q2, k, v, causal=causal, key_padding_mask=mask)[:, :, :5]
        if (why := gap(changed, out[:, :, :5], 1e-10, 1e-12)) is not None:
            failures.append(
                f"{'causal: ' if causal else ''}padded queries change the other queries' "
                f"outputs, {why}"
            )
    return failures


def check_masked(kernel: AttentionKernel) -> list[str]:
    q, k, v = (t.requires_grad_() for t in qkv(kernel, 4, 6))
    mask = torch.zeros(B, 6, dtype=torch.bool)
    mask[1] = True  # batch 1: every key is padding
    out = kernel(q, k, v, causal=modes(kernel)[0], key_padding_mask=mask)
    failures = []
    if not (torch.isfinite(out).all() and (out[1] == 0).all()):
        failures.append("a query with every key masked does not give zeros (or is not finite)")
    out.sum().backward()
    if not all(torch.isfinite(t.grad).all() for t in (q, k, v) if t.grad is not None):
        failures.append("gradients through a fully masked query are not finite")
    return failures


def state_numbers(state: Any) -> int:
    """The numbers a decode state holds (its floating-point tensors, masks aside)."""
    if isinstance(state, Tensor):
        return state.numel() if state.is_floating_point() else 0
    if isinstance(state, (tuple, list)):
        return sum(state_numbers(s) for s in state)
    if isinstance(state, dict):
        return sum(state_numbers(s) for s in state.values())
    return 0


def check_decode(kernel: AttentionKernel) -> list[str]:
    failures = []
    for padded in (False, True):
        q, k, v = qkv(kernel, 9, 9)
        mask = padding(9) if padded else None
        want = kernel(q, k, v, causal=True, key_padding_mask=mask)
        tag = "padded, " if padded else ""
        for name, edges in (("token by token", list(range(10))), ("chunks of 4", [0, 4, 8, 9])):
            state, outs = None, []
            for a, b in zip(edges[:-1], edges[1:], strict=True):
                step_mask = None if mask is None else mask[:, a:b]
                out, state = kernel.decode(
                    q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state, key_padding_mask=step_mask
                )
                outs.append(out)
            if (why := gap(torch.cat(outs, dim=2), want, 1e-10, 1e-12)) is not None:
                failures.append(f"{tag}{name}: decode != causal forward, {why}")
    return failures


def check_state(kernel: AttentionKernel) -> list[str]:
    failures = []
    sizes = {}
    for n in (4, 12):
        q, k, v = qkv(kernel, n, n)
        _, state = kernel.decode(q, k, v, None)
        held = state_numbers(state) // B
        sizes[n] = declared = kernel.state_size(n, DV)
        if held != declared:
            failures.append(
                f"after {n} tokens the state holds {held} numbers, state_size says {declared}"
            )
    if type(kernel).linear and sizes[4] != sizes[12]:
        failures.append(f"a linear kernel's state grows with n: {sizes[4]} -> {sizes[12]}")
    return failures


def check_memory(kernel: AttentionKernel) -> list[str]:
    q, k, v = qkv(kernel, 5, 7)
    mask = padding(7)
    want = kernel(q, k, v, key_padding_mask=mask)
    got = kernel.read_memory(q, kernel.memory(k, v, mask))
    why = gap(got, want, 1e-10, 1e-12)
    return [] if why is None else [f"read_memory(memory(k, v)) != forward, {why}"]


def check_gradients(kernel: AttentionKernel) -> list[str]:
    failures = []
    small = copy.deepcopy(kernel)
    params = [p for p in small.parameters() if p.requires_grad]
    for causal in modes(kernel):
        q, k, v = (t[:1, :, :4].clone().requires_grad_() for t in qkv(kernel, 4, 4))

        def fn(q: Tensor, k: Tensor, v: Tensor, *_: Tensor, causal: bool = causal) -> Tensor:
            return small(q, k, v, causal=causal)

        try:
            torch.autograd.gradcheck(fn, (q, k, v, *params), eps=1e-6, atol=1e-5, rtol=1e-4)
        except Exception as exc:  # gradcheck raises GradcheckError with a long report
            first = str(exc).strip().splitlines()[0]
            failures.append(f"{'causal' if causal else 'non-causal'}: {first}")
    return failures


def check_refusal(kernel: AttentionKernel) -> list[str]:
    """A kernel that cannot be causal refuses a causal call and decoding with its reason;
    one that can only be causal refuses a non-causal call and a memory with its reason."""
    q, k, v = qkv(kernel, 4, 4)
    if kernel.causal_refusal():
        why, said_by = kernel.causal_refusal(), "causal_refusal()"
        calls = (
            ("forward(causal=True)", lambda: kernel(q, k, v, causal=True)),
            ("decode", lambda: kernel.decode(q, k, v, None)),
        )
    else:
        why, said_by = kernel.noncausal_refusal(), "noncausal_refusal()"
        calls = (
            ("forward(causal=False)", lambda: kernel(q, k, v, causal=False)),
            ("memory", lambda: kernel.memory(k, v)),
        )
    failures = []
    for name, call in calls:
        try:
            call()
        except ValueError as exc:
            if str(exc) != why:
                failures.append(f"{name} refused with {str(exc)!r}, not its {said_by}")
        else:
            failures.append(f"{name} ran although {said_by} says: {why}")
    return failures


CAUSAL_ONLY = ("alignment", "future", "decode", "state")  # replaced by "refusal" where refused
NONCAUSAL_ONLY = ("memory",)  # a causal-only kernel's: replaced by "refusal"
CHECKS: dict[str, Callable[[AttentionKernel], list[str]]] = {
    "shapes": check_shapes,
    "reference": check_reference,
    "weights": check_weights,
    "rows": check_rows,
    "alignment": check_alignment,
    "future": check_future,
    "padding": check_padding,
    "masked": check_masked,
    "decode": check_decode,
    "state": check_state,
    "memory": check_memory,
    "gradcheck": check_gradients,
    "refusal": check_refusal,
}


def checks_for(kernel: AttentionKernel) -> list[str]:
    """The checks a kernel gets: the causal ones, or, if it cannot be causal, its refusal."""
    if kernel.causal_refusal() is not None:
        skip = CAUSAL_ONLY
    elif kernel.noncausal_refusal() is not None:
        skip = NONCAUSAL_ONLY
    else:
        skip = ("refusal",)
    return [name for name in CHECKS if name not in skip]


def check_kernel(factory: Factory, checks: Sequence[str] | None = None, seed: int = 0) -> list[str]:
    """Run the contract on the kernel ``factory`` builds; one line per failure."""
    torch.manual_seed(seed)
    kernel = build(factory)
    checks = checks_for(kernel) if checks is None else checks
    return run_checks({name: functools.partial(CHECKS[name], kernel) for name in checks})


def run_checks(checks: dict[str, Callable[[], list[str]]]) -> list[str]:
    """Run each named check; one line per failure, ``name: what``. A check that raises is
    a failure, said in one line."""
    failures = []
    for name, check in checks.items():
        try:
            found = check()
        except Exception as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            found = [f"raised {type(exc).__name__}: {message}"]
        failures += [f"{name}: {line}" for line in found]
    return failures


# ---------------------------------------------------------------- the layer around it


def layer_failures(
    factory: Factory, seed: int = 0, alibi: bool = False
) -> tuple[list[str], list[str]]:
    """The layer checks (module docstring) where the factory switches on a part of the
    layer or the kernel declares gate inputs: (the failures, the checks run)."""
    probe = build(factory)
    if probe.parts == LayerParts() and not probe.gate_inputs:
        return [], []
    # the multi-head layer sits a floor above the kernels (nn/); only this check needs it
    from transformers_lab.nn.attention import MultiHeadAttention  # noqa: PLC0415

    torch.manual_seed(seed)
    layer = perturbed(MultiHeadAttention(H * D, H, factory, alibi=alibi))
    both = modes(layer.kernel)
    causal = True in both
    checks: dict[str, Callable[[], list[str]]] = {
        "layer padding": lambda: layer_padding(layer, both),
        "layer gradcheck": lambda: layer_gradients(layer, both),
    }
    if causal:
        checks = {
            "layer decode": lambda: layer_decode(layer),
            "layer future": lambda: layer_future(layer),
            "layer state": lambda: layer_state(layer),
            **checks,
        }
    return run_checks(checks), list(checks)


def tokens(n: int) -> Tensor:
    return torch.randn(B, n, H * D, dtype=torch.float64)


def layer_decode(layer: torch.nn.Module) -> list[str]:
    device = next(layer.parameters()).device  # the layer's, default device or not
    failures = []
    for padded in (False, True):
        x = tokens(9).to(device)
        mask = padding(9).to(device) if padded else None
        want = layer(x, causal=True, key_padding_mask=mask)
        tag = "padded, " if padded else ""
        for name, edges in (("token by token", list(range(10))), ("chunks of 4", [0, 4, 8, 9])):
            state, outs = None, []
            for a, b in zip(edges[:-1], edges[1:], strict=True):
                step_mask = None if mask is None else mask[:, a:b]
                out, state = layer.decode(x[:, a:b], state, key_padding_mask=step_mask)
                outs.append(out)
            got = torch.cat(outs, dim=1)
            if padded:  # a padded token's own output is don't-care
                keep = ~mask[..., None]
                got, want_ = got * keep, want * keep
            else:
                want_ = want
            if (why := gap(got, want_, 1e-10, 1e-12)) is not None:
                failures.append(f"{tag}{name}: decode != causal forward, {why}")
    return failures


def layer_future(layer: torch.nn.Module) -> list[str]:
    x = tokens(9)
    out = layer(x, causal=True)
    x2 = x.clone()
    x2[:, 5:] += torch.randn_like(x2[:, 5:])
    why = gap(layer(x2, causal=True)[:, :5], out[:, :5], 1e-10, 1e-12)
    return [] if why is None else [f"outputs 0..4 change with tokens 5..8 (a leak), {why}"]


def layer_padding(layer: torch.nn.Module, both: tuple[bool, ...]) -> list[str]:
    failures = []
    for mode in both:
        x = tokens(7)
        mask = torch.zeros(B, 7, dtype=torch.bool)
        mask[1, 2] = mask[1, -1] = True  # a padded token inside the sequence too
        out = layer(x, causal=mode, key_padding_mask=mask)
        x2 = x.clone()
        x2[1, 2] = x2[1, -1] = 100 * torch.randn_like(x2[1, 2])
        changed = layer(x2, causal=mode, key_padding_mask=mask)
        keep = ~mask[..., None]
        if (why := gap(changed * keep, out * keep, 1e-10, 1e-12)) is not None:
            failures.append(
                f"{'causal: ' if mode else ''}padded tokens change the others' outputs, {why}"
            )
    return failures


def layer_state(layer: torch.nn.Module) -> list[str]:
    failures = []
    for n in (4, 12):
        _, state = layer.decode(tokens(n))
        held, declared = state_numbers(state) // B, layer.state_size(n)
        if held != declared:
            failures.append(
                f"after {n} tokens the layer's state holds {held} numbers, its state_size "
                f"says {declared}"
            )
    return failures


def layer_gradients(layer: torch.nn.Module, both: tuple[bool, ...]) -> list[str]:
    failures = []
    params = [p for p in layer.parameters() if p.requires_grad]
    for mode in both:
        x = tokens(4)[:1].requires_grad_()

        def fn(x: Tensor, *_: Tensor, mode: bool = mode) -> Tensor:
            return layer(x, causal=mode)

        try:
            torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-5, rtol=1e-4)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0]
            failures.append(f"{'causal' if mode else 'non-causal'}: {first}")
    return failures


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` kernel options, the values read as yaml (``hydra.searchpath`` aside:
    it names config dirs, not an option)."""
    import yaml

    options = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise CheckError(f"options are key=value, got {pair!r}")
        if key.lstrip("+") != "hydra.searchpath":
            options[key] = yaml.safe_load(value)
    return options


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m transformers_lab.attention.check",
        description="Check an attention kernel against the contract of transformers_lab.",
    )
    parser.add_argument(
        "target",
        help="an attention option (fastmax_p2), a registered kernel, package.module.Class, "
        "or a kernel yaml",
    )
    parser.add_argument(
        "options", nargs="*", help="kernel options, key=value; hydra.searchpath=[file://DIR]"
    )
    parser.add_argument(
        "--config-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="a config dir of yours whose attention/ holds TARGET (as on hydra.searchpath)",
    )
    parser.add_argument(
        "--alibi", action="store_true", help="check it with ALiBi's bias on its scores"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the checks run: cpu (default) or cuda[:N]"
    )
    args = parser.parse_args(argv)
    try:
        device = check_device(args.device)
        dirs = config_dirs(args.config_dir, args.options)
        full = kernel_factory(args.target, parse_options(args.options), dirs)
        factory = with_alibi(full) if args.alibi else full
        with device:
            failures = check_kernel(factory)
            ran = checks_for(build(factory))
            layer, layer_ran = layer_failures(full, alibi=args.alibi)
        failures, ran = failures + layer, ran + layer_ran
        if device.type != "cpu":
            failures += run_checks({"placement": lambda: check_placement(factory, device)})
            ran.append("placement")
    except (CheckError, UnknownKernel, TypeError, ValueError) as exc:  # it cannot be built
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in failures:
        print(f"FAIL {args.target}: {line}")
    if failures:
        return 1
    where = "" if device.type == "cpu" else f" on {device}"
    print(f"ok: {args.target} passes the {len(ran)} checks{where} ({', '.join(ran)})")
    return 0


def check_placement(factory: Factory, device: torch.device) -> list[str]:
    """The ``placement`` check (module docstring): the kernel, and its multi-head layer,
    built on the CPU, moved to ``device`` and run there; one line per failure."""
    from transformers_lab.nn.attention import MultiHeadAttention  # noqa: PLC0415

    torch.manual_seed(0)
    kernel = build(factory).to(device)
    both = modes(kernel)
    q, k, v = (t.to(device) for t in qkv(kernel, 6, 6))
    failures = []
    for causal in both:
        if (out := kernel(q, k, v, causal=causal)).device != q.device:
            failures.append(f"forward gave a tensor on {out.device}, its inputs on {q.device}")
    layer = perturbed(MultiHeadAttention(H * D, H, factory)).to(device)
    if True in both:  # its causal forward, and decode token by token and in chunks
        failures += [f"on {device}: {line}" for line in layer_decode(layer)]
    else:
        layer(tokens(6).to(device), causal=False)
    return failures


def check_device(name: str) -> torch.device:
    """The device the checks run on; one line if it is not there."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CheckError(f"--device {name!r} is not a device; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise CheckError(
            f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
    if device.type not in ("cpu", "cuda"):
        raise CheckError(f"--device {name!r}: the checks run on cpu or cuda")
    return device


if __name__ == "__main__":
    raise SystemExit(main())
