"""files.atomic_write: whole files or none, with a plain file's permissions."""

from __future__ import annotations

import os

import pytest

from transformers_lab.files import atomic_write, move_into_place


def test_text_bytes_and_writer_functions_land_whole(tmp_path):
    assert atomic_write(tmp_path / "a" / "t.txt", "héllo\n").read_text() == "héllo\n"
    assert (tmp_path / "b.bin").exists() is False
    atomic_write(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    atomic_write(tmp_path / "c.bin", lambda f: f.write(b"xyz"), sync=True)
    assert (tmp_path / "c.bin").read_bytes() == b"xyz"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = atomic_write(tmp_path / "f.txt", "old")

    def half(f):
        f.write(b"new, half")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        atomic_write(path, half)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_files_get_the_permissions_open_would_give(tmp_path):
    umask = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "p.txt", "x")
        assert path.stat().st_mode & 0o777 == 0o644  # mkstemp alone would give 0o600
        tmp = tmp_path / "tmp"
        tmp.write_text("y")
        os.chmod(tmp, 0o600)
        move_into_place(tmp, tmp_path / "q.txt")
        assert (tmp_path / "q.txt").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)
