"""fla's Triton kernels on the CPU, under Triton's interpreter (``TRITON_INTERPRET=1``): the
tests' own support, so that CI, which has no GPU, holds each fla backend equal to our loop.

Importing this module sets ``TRITON_INTERPRET=1`` (Triton reads it when a kernel is
decorated, so before fla's ops are imported) and makes four changes to Triton's
interpreter that fla's kernels need, and nothing else:

- an autotuner of several configs takes its first: the interpreter has no driver to time
  them with (on a GPU every config is compiled and timed);
- ``range`` inside a kernel yields Triton tensors, as compiled code does, not Python ints:
  fla writes ``(i * BT).to(tl.int64)`` of a loop index;
- a Triton builtin that a kernel calls by a name of its own (fla's DPLR kernels import
  ``gather``, which is ``tl.gather``) is interpreted, as the interpreter's ``tl.*`` are;
- a Triton function decorated before the interpreter was on (Triton's own library, where
  an earlier test had torch import Triton) is interpreted where a kernel calls it.

Half precision is not checked here: the interpreter's bf16 ``tl.dot`` is wrong. bf16 waits
for a GPU (tests/gpu, ``make gpu-window``).
"""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"


def _tensor_range(*args):
    """Python's range over ints or interpreter tensors, yielding interpreter tensors."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    def as_int(x):
        if isinstance(x, tl.constexpr):
            x = x.value
        if isinstance(x, tl.tensor):
            return int(x.handle.data.item())
        return int(x)

    for i in range(*(as_int(a) for a in args)):
        yield tl.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def _interpreted_builtin(builtin, semantic):
    """A Triton builtin called by a name of its own, as the interpreter calls ``tl.*``'s."""

    def call(*args, **kwargs):
        kwargs.pop("_semantic", None)
        return builtin(*args, **kwargs, _semantic=semantic)

    return call


def _patch() -> None:
    from triton.language import core as tl_core
    from triton.runtime import autotuner, interpreter

    if getattr(interpreter, "_tlab_patched", False):
        return

    def first_config(self, kwargs):
        return self.configs[:1]

    autotuner.Autotuner.prune_configs = first_config

    def compile_and_exec(self, transformed_ast):
        compiled = compile(transformed_ast, filename=self.filename, mode="exec")
        fn_globals = dict(self.fn.__globals__)  # a copy: the module's own range is untouched
        for key, value in vars(interpreter).items():
            fn_globals.setdefault(key, value)
        fn_globals["range"] = _tensor_range
        for key, value in fn_globals.items():  # a builtin imported by name (fla's gather)
            if tl_core.is_builtin(value):
                fn_globals[key] = _interpreted_builtin(value, interpreter.interpreter_semantic)
        local_namespace = {**self.kwargs}
        exec(compiled, fn_globals, local_namespace)
        return local_namespace[self.fn.__name__]

    interpreter.FunctionRewriter._compile_and_exec = compile_and_exec

    from triton.runtime.jit import JITFunction

    def call_interpreted(self, *args, **kwargs):
        return interpreter.InterpretedFunction(self.fn)(*args, **kwargs)

    JITFunction.__call__ = call_interpreted
    interpreter._tlab_patched = True


def interpret() -> None:
    """Triton's interpreter on, with the changes above (our own kernels need none of
    them, but share the process with fla's)."""
    _patch()


def fla_ops():
    """``fla.ops`` with its kernels interpreted; raises ImportError where fla is missing."""
    _patch()
    return importlib.import_module("fla.ops")
