"""What the entry points share: checking group options before Hydra composes, and
reporting a user's mistake as one line instead of a traceback."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence

from transformers_lab.builders import CONF_DIR, ConfigError
from transformers_lab.data import DataFileError

# values that are Hydra sweep functions or special, not option names
SWEEP_FUNCTION = re.compile(r"^\w+\(.*\)$")


def group_options(group: str) -> list[str]:
    """The options of a config group: the ``.yaml`` files in ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_overrides(argv: Sequence[str]) -> None:
    """Refuse ``group=option`` overrides whose option does not exist, listing the valid
    ones (Hydra would print its search path and a hint to set HYDRA_FULL_ERROR)."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~").split("@")[0]
        if key.startswith("hydra") or "." in key or not (CONF_DIR / key).is_dir():
            continue
        if SWEEP_FUNCTION.match(value):
            continue
        for choice in value.split(","):
            choice = choice.strip()
            if choice in ("null", "") or (CONF_DIR / key / f"{choice}.yaml").is_file():
                continue
            raise ConfigError(
                f"unknown {key} {choice!r}; valid options are: {', '.join(group_options(key))} "
                f"(conf/{key}/)"
            )


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn configuration and missing-data errors into one line on stderr and exit 2."""
    try:
        yield
    except (ConfigError, DataFileError) as exc:
        fail(str(exc))


def run_hydra(main: Callable[[], None], argv: Sequence[str] | None = None) -> None:
    """Check the command line's group options, then hand over to a ``@hydra.main``."""
    argv = sys.argv[1:] if argv is None else argv
    with user_errors():
        check_overrides(argv)
    main()
