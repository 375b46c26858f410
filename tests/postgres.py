"""A throwaway PostgreSQL server for the tests: ``initdb`` into a temporary dir, a server on
127.0.0.1 at a free port, a user with a password and an empty database; stopped and
removed afterwards.

The binaries are Debian's (``/usr/lib/postgresql/<version>/bin``) or on the PATH. The
server refuses to run as root, so under root the dir belongs to the ``postgres`` user and
the commands run as that user. Where no binaries exist, ``start`` raises ``Unavailable``
with the reason (the fixture skips with it).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

USER, PASSWORD, DATABASE = "tlab", "tlab-test-secret", "studies"


class Unavailable(RuntimeError):
    """No PostgreSQL server can be started here (the reason says why): the tests skip.
    A server that is there but fails to start is an error, not a skip."""


@dataclass
class Server:
    root: Path
    port: int
    bin: Path
    as_user: str | None  # run the commands as this user (under root)

    host = "127.0.0.1"

    def url(self, user: str = USER, password: str = PASSWORD, database: str = DATABASE) -> str:
        """A plain ``postgresql://`` URL, as a user writes it."""
        return f"postgresql://{user}:{password}@{self.host}:{self.port}/{database}"

    def run(self, *command: str) -> subprocess.CompletedProcess:
        argv = [str(self.bin / command[0]), *command[1:]]
        if self.as_user is not None:
            argv = ["runuser", "-u", self.as_user, "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self.run("pg_ctl", "stop", "-D", str(self.root / "data"), "-m", "immediate", "-w")
        shutil.rmtree(self.root, ignore_errors=True)


def binaries() -> Path:
    """The folder of ``initdb`` and ``pg_ctl``: Debian's newest, else the PATH's."""
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if debian:
        return debian[-1].parent
    found = shutil.which("initdb")
    if found is None:
        raise Unavailable("no PostgreSQL binaries (initdb, pg_ctl): install postgresql")
    return Path(found).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start() -> Server:
    """A running server with ``USER`` (password ``PASSWORD``) and ``DATABASE``."""
    bin_dir = binaries()
    as_user = None
    if os.geteuid() == 0:  # the server will not run as root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable("running as root and no postgres user to run the server") from None
        as_user = "postgres"
    root = Path(tempfile.mkdtemp(prefix="tlab-pg-"))
    if as_user is not None:
        shutil.chown(root, as_user)
    (root / "pw").write_text(PASSWORD + "\n")
    if as_user is not None:
        shutil.chown(root / "pw", as_user)
    server = Server(root, free_port(), bin_dir, as_user)
    data, sockets = root / "data", root / "sockets"
    try:
        server.run(
            "initdb", "-D", str(data), "-U", USER, f"--pwfile={root / 'pw'}",
            "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        sockets.mkdir()
        if as_user is not None:
            shutil.chown(sockets, as_user)
        options = f"-h 127.0.0.1 -p {server.port} -k {sockets} -c fsync=off"
        server.run("pg_ctl", "start", "-D", str(data), "-o", options, "-l", str(root / "log"), "-w")
        server.run("createdb", "-h", str(sockets), "-p", str(server.port), "-U", USER, DATABASE)
    except (OSError, subprocess.SubprocessError) as exc:  # stopped and removed, said why
        said = getattr(exc, "stderr", None) or str(exc)
        server.stop()
        raise RuntimeError(f"the test server did not start: {said.strip()[-500:]}") from None
    return server
