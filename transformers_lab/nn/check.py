"""The layer around a kernel, checked (``tlab-check``, ``transformers_lab.check``, runs
these after the kernel's own contract, ``attention.check``, whose docstring lists its
checks). With the layer's parts switched on (``short_conv=4``, ``output_gate=true``, ...;
``nn.parts``) or gate inputs declared, the multi-head layer built around the kernel is
checked too:

- ``layer decode``: the layer's ``decode``, token by token and in chunks, padded or not,
  equals its causal forward (the short convolution's window carried between calls);
- ``layer future``: a causal output does not change when later tokens do;
- ``layer padding``: padded tokens change no other token's output;
- ``layer state``: the decode state holds the layer's ``state_size(n)`` numbers;
- ``layer gradcheck``: float64 gradients of the input and every parameter.

On a GPU (``--device cuda``), one more:

- ``placement``: the kernel and its layer built on the CPU and moved to the GPU, as a
  model is, run forward (and decode) on tensors made there with no default device: a
  tensor the kernel makes without ``device=`` fails here, not in a training run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from transformers_lab.attention.check import run_checks
from transformers_lab.attention.testbed import (
    B,
    D,
    Factory,
    H,
    build,
    gap,
    modes,
    padding,
    perturbed,
    qkv,
    state_numbers,
    with_alibi,
)
from transformers_lab.nn.multihead import MultiHeadAttention
from transformers_lab.nn.parts import LayerParts, split_layer_parts


def layer_failures(
    factory: Factory, seed: int = 0, alibi: bool = False
) -> tuple[list[str], list[str]]:
    """The layer checks (module docstring) where the factory switches on a part of the
    layer or the kernel declares gate inputs: (the failures, the checks run)."""
    kernel, parts = split_layer_parts(factory)
    if parts == LayerParts() and not build(kernel).gate_inputs:
        return [], []
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


def check_placement(full: Factory, device: torch.device, alibi: bool = False) -> list[str]:
    """The ``placement`` check (module docstring): the kernel, and its multi-head layer
    (the layer's switches that ``full`` carries switched on), built on the CPU, moved to
    ``device`` and run there; one line per failure."""
    torch.manual_seed(0)
    factory, _ = split_layer_parts(full)
    kernel = build(with_alibi(factory) if alibi else factory).to(device)
    both = modes(kernel)
    q, k, v = (t.to(device) for t in qkv(kernel, 6, 6))
    failures = []
    for causal in both:
        if (out := kernel(q, k, v, causal=causal)).device != q.device:
            failures.append(f"forward gave a tensor on {out.device}, its inputs on {q.device}")
    layer = perturbed(MultiHeadAttention(H * D, H, full, alibi=alibi)).to(device)
    if True in both:  # its causal forward, and decode token by token and in chunks
        failures += [f"on {device}: {line}" for line in layer_decode(layer)]
    else:
        layer(tokens(6).to(device), causal=False)
    return failures
