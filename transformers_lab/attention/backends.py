"""What runs a kernel's training forward: our loop, or a fused kernel for the same math.

``attention.backend`` names it, on every kernel that a fused kernel covers:

- ``auto`` (the default): the fused kernel on a CUDA tensor where it is installed (fla
  first, then FlexAttention), our loop everywhere else: CPU results do not change;
- ``loop``: our loop, on any device (``null``, the name before the option had others,
  means the same);
- ``fla``: flash-linear-attention's Triton kernel (``fla_ops``): CUDA, or the CPU under
  Triton's interpreter (``TRITON_INTERPRET=1``, the tests' way);
- ``flex``: PyTorch's FlexAttention (``flex_ops``): CUDA; on a CPU its forward only;
- ``triton``: our own Triton kernel for fastmax p=2 in linear time (``triton_ops``): CUDA,
  or the CPU under Triton's interpreter. ``auto`` does not take it until a GPU bench
  (``make gpu-window``) has shown it faster than fla's.

A kernel lists the fused kernels that cover it in ``fused_backends``; asking a kernel for
one it does not list, or for one that cannot run on this machine, is refused in one line
when the kernel is built. A fused kernel serves the calls it covers (fla: causal
self-attention, what a training step makes; FlexAttention: every call of the polynomial
kernels, self-attention for the window); every other call (decoding, ``weights``) runs our
paths, on the same math, so a checkpoint moves between backends.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch

BACKENDS = ("auto", "loop", "fla", "flex", "triton")
FUSED = ("fla", "flex", "triton")
UNPROVEN = ("triton",)  # fused kernels ``auto`` passes over: not yet timed on a GPU
INSTALL = "pip install -e '.[gpu]' (fla-core, fla's ops)"


def interpreted() -> bool:
    """Triton's interpreter is on (``TRITON_INTERPRET=1``): Triton kernels run on a CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def fla_import_error() -> str | None:
    """Why ``fla.ops`` cannot be imported (None: it can)."""
    try:
        importlib.import_module("fla.ops")
    except Exception as exc:  # not installed, or a Triton / torch it cannot work with
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"flash-linear-attention cannot be imported ({type(exc).__name__}: {why}); {INSTALL}"
    return None


def unavailable(backend: str) -> str | None:
    """Why the fused ``backend`` cannot run on this machine (None: it can)."""
    if backend == "fla":
        if not (torch.cuda.is_available() or interpreted()):
            return "no CUDA GPU is visible (fla's kernels are Triton kernels for CUDA)"
        return fla_import_error()
    if backend == "triton":
        if not (torch.cuda.is_available() or interpreted()):
            return "no CUDA GPU is visible (the fused kernel is a Triton kernel for CUDA)"
        try:
            importlib.import_module("triton")
        except ImportError:
            return f"Triton cannot be imported; {INSTALL}"
        return None
    if backend == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:
            return f"this torch ({torch.__version__}) has no FlexAttention (torch >= 2.5 has)"
        return None
    return None


def check_device(t: torch.Tensor, backend: str) -> None:
    """One line unless ``t`` is on CUDA (or Triton's interpreter runs kernels on the CPU):
    the check of a Triton backend (``fla``, ``triton``) when it is called."""
    if t.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"attention.backend={backend} runs on CUDA only, got tensors on {t.device.type}; "
            "move the model to a GPU (trainer=gpu) or use attention.backend=auto"
        )


def check_backend(name: str, backend: Any, covers: tuple[str, ...]) -> str:
    """``backend`` as the kernel ``name`` keeps it (None is ``loop``), or one line on why it
    cannot be: not a backend, not one that covers the kernel (``covers``), or not
    runnable here."""
    if backend is None:
        return "loop"
    ours = ", ".join(("auto", "loop", *covers))
    if backend not in BACKENDS:
        raise ValueError(
            f"{name}: unknown attention.backend={backend!r}; {name} takes one of {ours} "
            "(auto: the fused kernel on CUDA where installed, else our loop)"
        )
    if backend in FUSED and backend not in covers:
        covered = f"it takes {ours}" if covers else "no fused kernel covers it"
        raise ValueError(
            f"{name}: attention.backend={backend} is not a fused kernel for {name} ({covered}); "
            "use attention.backend=auto"
        )
    if backend in FUSED and (why := unavailable(backend)):
        raise ValueError(
            f"{name}: attention.backend={backend} cannot run on this machine: {why}; use "
            "attention.backend=auto (our loop here)"
        )
    return backend


def choose(backend: str, covers: tuple[str, ...], device: torch.device) -> str | None:
    """The fused kernel a call on ``device`` takes (None: our loop): ``auto`` takes the
    first of ``covers`` that runs on a CUDA device, an explicit name itself."""
    if backend == "loop":
        return None
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return None
    return next((b for b in covers if b not in UNPROVEN and unavailable(b) is None), None)


def settle(name: str, backend: str, fused: str | None, why: str | None) -> str | None:
    """The fused kernel a call takes, given why it cannot take this call (``why``, None:
    it can): under ``auto`` our loop then, one line where the user named it."""
    if fused is None or why is None:
        return fused
    if backend == fused:
        raise ValueError(f"{name}: attention.backend={fused}: {why}; use attention.backend=auto")
    return None


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a fused kernel runs in: autocast's where it is on, else the tensor's."""
    device = t.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype
