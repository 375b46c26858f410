"""Where a sweep's Optuna study is kept: a SQLAlchemy URL (``sqlite:///<path>``,
``postgresql://...``) or Optuna's journal file (``journal:<path>``), opened with a one-line
refusal that says what to give instead, printed with its password hidden, and locked while
workers started together set the study up.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import optuna

from transformers_lab.errors import ConfigError
from transformers_lab.files import file_lock

log = logging.getLogger(__name__)

JOURNAL_PREFIX = "journal:"


def open_storage(url: str, heartbeat_interval: int | None = None) -> optuna.storages.BaseStorage:
    """The storage at ``url``: a SQLAlchemy URL (``sqlite:///<path>``, ``postgresql://...``)
    or ``journal:<path>``, Optuna's journal file (for network file systems whose locks
    SQLite cannot trust). A SQLite file's folder is created; anything that cannot be
    opened is one line saying what to give instead."""
    hint = (
        "give hydra.sweeper.storage a SQLAlchemy URL (sqlite:///<path>/study.db, "
        "postgresql://<user>@<host>/<db>) or journal:<path>"
    )
    given, url = url, with_driver(url)  # messages show the URL as it was given
    try:
        file = storage_file(url)
        if file is not None:  # its folder is made here
            file.parent.mkdir(parents=True, exist_ok=True)
        if url.startswith(JOURNAL_PREFIX):
            from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

            backend = JournalFileBackend(str(file), lock_obj=JournalFileOpenLock(str(file)))
            return optuna.storages.JournalStorage(backend)
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        engine_kwargs: dict[str, Any] = {}
        if parsed.get_backend_name() == "sqlite":
            # several workers on one file wait for its lock rather than fail at once
            engine_kwargs["connect_args"] = {"timeout": 60}
        for attempt in range(3):
            try:
                with warnings.catch_warnings():  # heartbeats are "experimental" (Optuna 2.9)
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    return optuna.storages.RDBStorage(
                        url,
                        engine_kwargs=engine_kwargs,
                        heartbeat_interval=heartbeat_interval,
                        grace_period=None if heartbeat_interval is None else 4 * heartbeat_interval,
                    )
            except Exception as exc:
                # workers that start together on a new database race to create its tables:
                # the loser finds them made by the winner when it opens the storage again
                if attempt == 2 or not created_meanwhile(exc):
                    raise
                time.sleep(0.5 * (attempt + 1))
    except ImportError as exc:
        raise ConfigError(
            f"cannot open the study storage {printable_url(given)}: its database driver is not "
            f"installed ({exc}); install it (psycopg for postgresql, pymysql for mysql) or "
            f"{hint}"
        ) from None
    except Exception as exc:  # SQLAlchemy's parse and connection errors, OS errors
        reason = " ".join(str(exc).split("(Background on this error")[0].split())
        said = server_refusal(url, reason) or f"{reason}; {hint}"
        raise ConfigError(f"cannot open the study storage {printable_url(given)}: {said}") from None


def with_driver(url: str) -> str:
    """A ``postgresql://`` URL as users write it, on the driver that is installed.

    SQLAlchemy reads a bare ``postgresql://`` as psycopg2's; where only psycopg (3, the
    project's dependency) is installed, the URL is given its name, ``postgresql+psycopg://``.
    ``postgres://`` (Heroku's and libpq's spelling, which SQLAlchemy no longer takes) is
    read as ``postgresql://``. Any other URL comes back as it is."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        return url
    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg"):
        return f"postgresql+psycopg://{rest}"
    return f"postgresql://{rest}"


def server_refusal(url: str, reason: str) -> str | None:
    """What a database server's refusal to connect means, in one line with the fix: no
    server at the host and port, a wrong password or user, a database that does not
    exist. None for any other error."""
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:
        return None
    if parsed.get_backend_name() != "postgresql":
        return None
    host, port = parsed.host or "localhost", parsed.port or 5432
    where = f"{host}:{port}"
    user, database = parsed.username or os.environ.get("USER", "?"), parsed.database
    if "failed to resolve host" in reason or "could not translate host name" in reason:
        return f"no host {host!r} is known here; give the server's name or address"
    if "Connection refused" in reason or "could not connect" in reason:
        return (
            f"no PostgreSQL server answers at {where} (connection refused); start it, or "
            "give the host and port it listens on"
        )
    if "password authentication failed" in reason or "no password supplied" in reason:
        return (
            f"the server at {where} refused user {user!r}: wrong or missing password; give "
            f"it in the URL (postgresql://{user}:<password>@{where}/{database}) or in "
            "PGPASSWORD"
        )
    if f'role "{user}" does not exist' in reason:
        return f"the server at {where} has no user {user!r}; give a user it knows"
    if f'database "{database}" does not exist' in reason:
        return (
            f"the server at {where} has no database {database!r}; create it (createdb -h "
            f"{host} -p {port} -U {user} {database}) or name one that exists"
        )
    return None


def storage_file(url: str) -> Path | None:
    """The file a storage keeps (``journal:<path>``, ``sqlite:///<path>``); None for a
    database server, an in-memory SQLite or a URL that does not parse."""
    if url.startswith(JOURNAL_PREFIX):
        return Path(url[len(JOURNAL_PREFIX) :]).expanduser()
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # open_storage says what is wrong with it
        return None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        return Path(parsed.database).expanduser()
    return None


def created_meanwhile(exc: Exception) -> bool:
    """Whether opening a storage failed because another worker was creating its schema."""
    text = str(exc).lower()
    return any(m in text for m in ("already exists", "unique constraint", "duplicate key"))


@contextlib.contextmanager
def setup_lock(url: str):
    """Hold a lock beside a file storage (SQLite, journal) while a worker opens it and
    loads or creates its study, so that workers started together take turns there; a
    database server needs none (``open_storage`` retries its schema race)."""
    path = storage_file(url)
    if path is None or importlib.util.find_spec("fcntl") is None:  # a server, or not POSIX:
        yield  # the storage's own retry is all there is
        return
    with file_lock(path.with_name(path.name + ".setup.lock")) as refused:
        if refused is not None:  # a file system without flock (Lustre without -o flock, ...)
            log.warning(
                "study storage %s: no file lock here (%s); workers set up the study without "
                "taking turns",
                printable_url(url),
                refused,
            )
        yield


def printable_url(url: str) -> str:
    """A storage URL as it may be printed: its password hidden."""
    if url.startswith(JOURNAL_PREFIX):
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url
