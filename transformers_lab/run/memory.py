"""Freed memory kept for reuse on the CPU: the ``keep_freed_memory`` setting (on by
default in every command that builds a model).

glibc's malloc gives each block above its mmap threshold a mapping of its own and unmaps
it when it is freed. The threshold starts at 128 KiB and rises with what is freed, but
never above 32 MiB. A tensor of 32 MiB or more therefore gets fresh pages each time it is
made, and the kernel zeroes every 4 KiB page on its first touch. A training step that
makes and frees such temporaries pays for that in system time. In MAD's fuzzy recall,
KDA's trained gates decay fast enough that its scores are formed channel by channel, a
33.5 MB tensor: there a step took 800 ms of system time beside 1,100 ms of user time, with
290,000 page faults.

``keep_freed_memory`` makes malloc take every block from its heap and never give the
heap's top back to the system. A freed block is then reused by a later tensor that fits
it: a loop that makes the same tensors step after step stops faulting once the heap has
found its shape (a few steps: torch's aligned blocks leave small neighbours that must be
free too). The same step took 12 ms of system time and 4,600 page faults, and the
process's peak resident memory rose by a fifth (1.47 to 1.80 GB). This is glibc's
``mallopt``; where there is none (macOS, musl), nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes: 2 GiB free at the heap's top


@functools.cache
def libc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library has none."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def set_malloc(*settings: tuple[int, int]) -> bool:
    """Give glibc's malloc each (parameter, value); whether it took them all (False where
    there is no ``mallopt``)."""
    mallopt = libc_mallopt()
    if mallopt is None:
        return False
    return all([bool(mallopt(parameter, value)) for parameter, value in settings])


def keep_freed_memory() -> bool:
    """From now on, in this process, malloc maps no block of its own and keeps the heap's
    freed top: freed tensors' memory is reused, not returned and faulted in again."""
    return set_malloc((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM))
