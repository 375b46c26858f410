"""The linear paths' chunk steps, eager or compiled.

Each path (``chunked.py`` causal, ``factorized.py`` non-causal) loops over chunks in
Python and does a chunk's work in one step function. ``steps(compiled=True)`` gives the
same functions through ``torch.compile`` (Inductor): the feature products, the
polynomial and its mask, and the feature map's vector-Jacobian product around the
matmuls become a few fused loops instead of some forty small tensor operations, each a
pass over memory. A step compiles once per shape (seconds; Inductor keeps it on disk
for later processes). Where the compiler cannot run (no C++ compiler, an unsupported
platform), the step says so once and runs eagerly.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from types import SimpleNamespace

import torch

log = logging.getLogger(__name__)

STEP_NAMES = (
    "forward_step",  # chunked: a chunk's output and the state after it
    "backward_step",  # chunked: a chunk's gradients and the state's, going back
    "state_step",  # factorized: a chunk of keys joins the state
    "read_step",  # factorized: a chunk of queries reads it
    "query_grad_step",  # factorized: a chunk of queries' gradients, and the state's
    "key_grad_step",  # factorized: a chunk of keys' and values' gradients
)


@functools.cache
def steps(compiled: bool = False) -> SimpleNamespace:
    """The step functions by name (``STEP_NAMES``), eager or through ``torch.compile``."""
    # the modules (the package's names ``factorized`` and ``chunked_causal`` are functions)
    modules = [importlib.import_module(f"{__package__}.{m}") for m in ("chunked", "factorized")]
    eager = {n: next(getattr(m, n) for m in modules if hasattr(m, n)) for n in STEP_NAMES}
    if not compiled:
        return SimpleNamespace(**eager)
    return SimpleNamespace(**{name: compile_step(fn) for name, fn in eager.items()})


def compile_step(fn: Callable) -> Callable:
    """``fn`` through ``torch.compile``, or eagerly from the first time that fails.

    A step compiles once per shape of its blocks (batch, heads, chunk, head width, dtype),
    not per N: the paths hand it chunk-major blocks. Past torch's recompile limit (8
    shapes) a new shape runs eagerly, said once, while the shapes compiled keep their code.
    """
    # static shapes: a kernel specialised to its block shape; the strides of the blocks do
    # not depend on N, so a new N costs no recompile
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    failed: list[str] = []
    over_limit: list[bool] = []

    @functools.wraps(fn)
    def step(*args):
        if not failed:
            try:
                return compiled(*args)
            except Exception as exc:  # a compiler that cannot run here, or a real error
                result = fn(*args)  # a real error raises again here, eagerly
                if type(exc).__name__ == "FailOnRecompileLimitHit":
                    if not over_limit:
                        over_limit.append(True)
                        log.warning(
                            "attention: the linear path's %s met torch.compile's recompile "
                            "limit (torch._dynamo.config.recompile_limit): new shapes run "
                            "eagerly",
                            fn.__name__,
                        )
                    return result
                first = (str(exc).splitlines() or [""])[0][:200]
                failed.append(f"{type(exc).__name__}: {first}")
                log.warning(
                    "attention: torch.compile of the linear path's %s failed (%s); it runs eagerly",
                    fn.__name__,
                    failed[0],
                )
                return result
        return fn(*args)

    step.failed = failed  # type: ignore[attr-defined]
    return step
