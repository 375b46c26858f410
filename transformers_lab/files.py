"""Files written whole or not at all: through a temporary file in the target's folder,
then a rename (atomic on one file system), so that a reader never sees half a file and a
crash never leaves one; and a lock file that processes take turns on."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


def move_into_place(tmp: str | Path, path: str | Path) -> None:
    """Rename a finished temporary file onto ``path``, with the permissions a plain
    ``open()`` would have given it (``mkstemp`` makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def atomic_write(
    path: str | Path, content: str | bytes | Callable[[IO[Any]], None], sync: bool = False
) -> Path:
    """Write ``content`` (text, bytes, or a function that writes into the open binary
    file) to ``path`` through a temporary file and a rename; ``sync`` flushes it to disk
    first. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        move_into_place(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[OSError | None]:
    """An exclusive lock on the file ``path`` (made, with its folder, where missing), held
    for the block: processes of this machine, or of others on a shared file system, take
    turns. Yields None once it is held, or the error of a file system without locks
    (Lustre mounted without ``flock``): the block then runs unguarded, which the caller
    says. POSIX only (``fcntl``)."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:
            yield exc
            return
        try:
            yield None
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
