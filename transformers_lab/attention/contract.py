"""What keeps kernels and mixers of the earlier contract, and the callers of ours, working:
each change of a name is taken under its old name too, said once a class.

- a kernel class of ours is called with the old keyword ``num_heads`` (``n_head`` now);
- a kernel or mixer class of a user's still takes ``num_heads`` (``call_with_heads``
  gives it that);
- a kernel class takes no ``backend`` (it runs its own code: ``auto`` or ``loop``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from transformers_lab.attention.backends import check_backend

log = logging.getLogger(__name__)

NOTED: set[Any] = set()  # the classes and callers of the old contract said once


def note_once(key: Any, message: str, *args: Any) -> None:
    if key not in NOTED:
        NOTED.add(key)
        log.warning(message, *args)


def takes_backend(init: Any) -> Any:
    """A kernel class's ``__init__`` that takes ``backend`` whether or not its own does (a
    kernel that takes none takes ``backend=auto`` or ``loop``, a sweep's setting for every
    kernel, and refuses a fused one in one line: ``attention.backends``), and that takes
    the old keyword ``num_heads`` for its ``n_head``, with one note a class."""
    params = inspect.signature(init).parameters
    own_backend = "backend" in params
    renames = "n_head" in params and "num_heads" not in params

    @functools.wraps(init)
    def init_as_contracted(self: Any, *args: Any, **kwargs: Any) -> None:
        if renames and "num_heads" in kwargs and "n_head" not in kwargs:
            kwargs["n_head"] = kwargs.pop("num_heads")
            name = type(self).__name__
            note_once(
                (type(self), "caller"), "note: %s(num_heads=...) is now %s(n_head=...)", name, name
            )
        if not own_backend and "backend" in kwargs:  # auto and loop are ours; no fused one
            check_backend(self.name, kwargs.pop("backend"), ())
        init(self, *args, **kwargs)

    return init_as_contracted


def call_with_heads(factory: Any, n_head: int, **sizes: int) -> Any:
    """``factory(**sizes, n_head=n_head)``: a kernel (``head_dim=``) or a mixer
    (``d_model=``). A factory of the old contract, whose class takes ``num_heads`` and no
    ``n_head``, gets ``num_heads=`` and one note a class, so that it keeps working."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: the contract's name
        params = {}
    if "n_head" in params or "num_heads" not in params:
        return factory(**sizes, n_head=n_head)
    target = getattr(factory, "func", factory)  # Hydra's partial of a class, or the class
    note_once(
        target,
        "note: %s takes num_heads; the %s contract now calls it n_head (rename the parameter)",
        getattr(target, "__name__", repr(target)),
        "kernel" if "head_dim" in sizes else "mixer",
    )
    return factory(**sizes, num_heads=n_head)
