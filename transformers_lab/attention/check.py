"""The kernel contract, checked on any kernel, the user's own included::

    tlab-check fastmax p=1
    tlab-check fastmax_p2
    tlab-check mine --config-dir my_conf
    tlab-check my_package.kernels.MyKernel scale=0.5
    tlab-check my_conf/attention/mine.yaml
    tlab-check gla --device cuda

TARGET is any name the ``attention`` group takes (the user's own with ``--config-dir DIR``
or ``hydra.searchpath=[file://DIR]``, as ``tlab-train`` takes it), a registered kernel, a
class path ``package.module.Class``, or a kernel's yaml (``attention/resolve.py``);
``key=value`` pairs are kernel options. The checks, on float64 inputs with the kernel's
learned parameters moved off their initial values (``testbed``):

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
gates for the same token. ``tlab-check`` (``transformers_lab.check``) also checks the
multi-head layer around the kernel, where the kernel's config switches on a part of the
layer or the kernel declares gate inputs, and with ``--device cuda`` its placement on the
GPU (``nn.check``: the layer is ``nn``'s). ``python -m transformers_lab.attention.check``
takes the same arguments and runs the kernel's own checks, then says in one line that
``tlab-check`` checks the layer around it.

One line per failure, and exit status 1 if any; ``ok`` and exit status 0 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import functools
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from transformers_lab.attention.base import AttentionKernel
from transformers_lab.attention.masks import visible_keys
from transformers_lab.attention.resolve import (
    UnknownKernel,
    config_dirs,
    kernel_factory,
    layer_factory,
    parse_options,
)
from transformers_lab.attention.testbed import (
    DV,
    B,
    CheckError,
    Factory,
    H,
    build,
    check_device,
    gap,
    modes,
    padding,
    qkv,
    state_numbers,
    tokens,
    with_alibi,
)

SHAPES = [(7, 7), (3, 9), (9, 4)]  # (Nq, Nk): self, fewer queries, more queries


# ---------------------------------------------------------------- the checks


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
    tokens(kernel, k2, 5).add_(torch.randn_like(tokens(kernel, k2, 5)))
    tokens(kernel, v2, 5).add_(torch.randn_like(tokens(kernel, v2, 5)))
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
        for t in (k2, v2):  # the last two tokens of batch 1
            last = tokens(kernel, t, 5)[1]
            last.copy_(100 * torch.randn_like(last))
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
                    q[:, :, a:b],
                    tokens(kernel, k, a, b),
                    tokens(kernel, v, a, b),
                    state,
                    key_padding_mask=step_mask,
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
    if type(kernel).constant_state and sizes[4] != sizes[12]:
        failures.append(f"a constant-state kernel's state grows with n: {sizes[4]} -> {sizes[12]}")
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
        q, k, v = (t[:1].clone().requires_grad_() for t in qkv(kernel, 4, 4))

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


# ---------------------------------------------------------------- the command line

BUILD_ERRORS = (CheckError, UnknownKernel, TypeError, ValueError)  # a target not built


def command_line(prog: str) -> argparse.ArgumentParser:
    """The check's arguments: ``tlab-check``'s, and this module's own command line's."""
    parser = argparse.ArgumentParser(
        prog=prog,
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
    return parser


@dataclass
class Target:
    """What a command line of the check names: the kernel alone (ALiBi's bias on where
    ``alibi``), with the layer's switches its config carries, and where it runs."""

    name: str
    kernel: Factory
    layer: Factory
    alibi: bool
    device: torch.device


def read_target(args: argparse.Namespace) -> Target:
    """The target of ``command_line``'s arguments; one of ``BUILD_ERRORS`` if it names no
    kernel that builds."""
    device = check_device(args.device)
    dirs = config_dirs(args.config_dir, args.options)
    options = parse_options(args.options)
    layer = layer_factory(args.target, options, dirs)  # the layer's switches on
    kernel = kernel_factory(args.target, options, dirs)
    factory = with_alibi(kernel) if args.alibi else kernel
    return Target(args.target, factory, layer, args.alibi, device)


def kernel_checks(target: Target) -> tuple[list[str], list[str]]:
    """The kernel's checks (``checks_for``) on the target's device: (failures, checks run)."""
    with target.device:
        return check_kernel(target.kernel), checks_for(build(target.kernel))


def refused(exc: Exception) -> int:
    """A target that cannot be built, said in one line: exit status 2."""
    print(f"error: {exc}", file=sys.stderr)
    return 2


def report(target: Target, failures: list[str], ran: list[str]) -> int:
    """One line per failure and exit status 1, or one ``ok`` line with the checks run and 0."""
    for line in failures:
        print(f"FAIL {target.name}: {line}")
    if failures:
        return 1
    where = "" if target.device.type == "cpu" else f" on {target.device}"
    print(f"ok: {target.name} passes the {len(ran)} checks{where} ({', '.join(ran)})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The kernel's own checks on the device named, and a line that points to
    ``tlab-check``, which checks the layer around the kernel too (this package imports
    nothing above it)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = command_line("python -m transformers_lab.attention.check").parse_args(argv)
    try:
        target = read_target(args)
        failures, ran = kernel_checks(target)
    except BUILD_ERRORS as exc:
        return refused(exc)
    status = report(target, failures, ran)
    print(f"the kernel alone; the layer around it too: tlab-check {shlex.join(argv)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
