"""The data root, and verified, atomic downloads."""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.request
from pathlib import Path

from transformers_lab.errors import DataFileError
from transformers_lab.files import move_into_place

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def data_root(root: str | os.PathLike | None = None) -> Path:
    """``root`` if given, else ``$TLAB_DATA_DIR``, else ``<project>/data``."""
    if root is not None:
        return Path(root).expanduser()
    return Path(os.environ.get("TLAB_DATA_DIR", PROJECT_ROOT / "data")).expanduser()


def file_digest(path: Path, algorithm: str = "sha256", chunk: int = 1 << 20) -> str:
    """Hex digest of a file."""
    digest = hashlib.new(algorithm)
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _split_checksum(checksum: str) -> tuple[str, str]:
    """'md5:abc' -> ('md5', 'abc'); a bare hex digest is sha256."""
    algorithm, _, value = checksum.rpartition(":")
    return algorithm or "sha256", value


def fetch(url: str, path: Path, timeout: float = 60.0) -> None:
    """Download ``url`` to ``path``; overridable in tests (no network there)."""
    with urllib.request.urlopen(url, timeout=timeout) as response, path.open("wb") as out:
        while block := response.read(1 << 20):
            out.write(block)


def ensure_file(path: Path, url: str, checksum: str, *, download: bool = True) -> Path:
    """Return ``path`` once it holds the file of ``checksum`` (a sha256 hex digest, or
    ``md5:<hex>`` where only an MD5 is published), downloading it from ``url`` if missing.

    The download goes to a temporary file in the same folder, is verified, and only then
    renamed into place, so a failed or corrupted download leaves nothing behind. An
    existing file that fails its checksum is an error (it is not silently replaced).
    """
    path = Path(path)
    algorithm, expected = _split_checksum(checksum)
    if path.exists():
        actual = file_digest(path, algorithm)
        if actual != expected:
            raise DataFileError(
                f"{path} fails its checksum: {algorithm} {actual}, expected {expected}. It is "
                f"corrupted or a different version; delete it to download it again from {url}"
            )
        return path
    if not download:
        raise DataFileError(
            f"{path} is missing and downloads are off; get it from {url} "
            f"({algorithm} {expected}) and place it at {path}"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataFileError(
            f"cannot create {path.parent} to download {url} into ({exc.strerror}); point "
            "TLAB_DATA_DIR (or data.root=) at a folder that can be written, or place the "
            f"file at {path} yourself"
        ) from None
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            fetch(url, tmp)
        # URLError, timeouts and refused connections are OSErrors; a transfer cut short is
        # an HTTPException (IncompleteRead), a malformed URL a ValueError
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise DataFileError(
                f"could not download {url} ({exc}). Offline? Download it elsewhere and place "
                f"it at {path} ({algorithm} {expected}), or point TLAB_DATA_DIR at a folder that "
                "has it"
            ) from None
        actual = file_digest(tmp, algorithm)
        if actual != expected:
            raise DataFileError(
                f"the download of {url} fails its checksum: {algorithm} {actual}, expected "
                f"{expected}; nothing was written to {path}"
            )
        move_into_place(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
