"""The one reader of Hydra overrides (``key=value`` on a command line or in a job's
``overrides.yaml``), and what they say about a job's identity."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SEED_KEYS = ("seed",)  # overrides that repeat a run rather than change it
# overrides that do not change what runs (summary.* only says how the sweep is summarised;
# trial is the Optuna trial number a study sweeper gives its job)
BOOKKEEPING_KEYS = ("skip_finished", "fail_fast", "summary", "trial")


@dataclass(frozen=True)
class Override:
    """``[+|++|~]key[@package]=value``: ``key`` without its prefix, ``group`` without the
    package, ``value`` None where there is no ``=`` (``~key`` deletes)."""

    prefix: str
    key: str
    value: str | None

    @property
    def group(self) -> str:
        return self.key.split("@", 1)[0]

    def unquoted(self) -> str:
        """The value without the quotes Hydra allows around it."""
        value = self.value or ""
        if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
            return value[1:-1]
        return value


def parse(text: str) -> Override:
    """One override: ``+trainer.x=1`` -> Override('+', 'trainer.x', '1')."""
    head, eq, value = str(text).partition("=")
    key = head.lstrip("+~")
    return Override(head[: len(head) - len(key)], key, value if eq else None)


def bookkeeping(key: str) -> bool:
    """Whether an override of ``key`` leaves what a job runs as it is."""
    return key.split(".", 1)[0] in BOOKKEEPING_KEYS


def override_key(text: str) -> str:
    """The key an override sets: ``+trainer.x=1`` -> ``trainer.x``."""
    return parse(text).key


def overrides_in(argv: Iterable[str]) -> list[Override]:
    """The overrides among command-line arguments (flags and their values left out)."""
    return [parse(a) for a in argv if not a.startswith("-") and "=" in a]


def override_map(overrides: Sequence[str]) -> dict[str, str]:
    """``key -> value`` of a job's overrides, bookkeeping keys left out."""
    parsed = (parse(o) for o in overrides)
    return {o.key: o.value for o in parsed if o.value is not None and not bookkeeping(o.key)}


def identity(overrides: Sequence[str]) -> list[str]:
    """The overrides that say what a job is: its own, bookkeeping keys left out."""
    return [o for o in overrides if not bookkeeping(override_key(o))]


def same_job(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two lists of overrides run the same job (order and bookkeeping aside)."""
    return sorted(identity(a)) == sorted(identity(b))
