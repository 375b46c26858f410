"""The error types that every layer of transformers_lab raises (a run stopped by a signal
is ``run.record.Interrupted``, beside the record that keeps it).

Each says what went wrong and how to fix it, in one line; the entry points print it as
``error: <message>`` and exit with status 2 (``cli.user_errors``), or, for a run that
stopped on purpose, with the run's own status (``RunStopped.exit_code``).
"""

from __future__ import annotations


def must_be(key: str, expected: str, value: object) -> str:
    """The one wording of a value out of its range: ``n_head must be an integer >= 1, got
    0``; the constructor that owns ``key`` raises it."""
    return f"{key} must be {expected}, got {value!r}"


def at_least(least: int, **values: object) -> None:
    """Raise ``ValueError`` (``must_be``'s words) unless each of ``values`` is an integer
    of at least ``least``: a constructor's counts and sizes."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(must_be(key, f"an integer >= {least}", value))


# what a user should give where a checkpoint is asked for
GIVE_CHECKPOINT = "give ckpt_path=<run dir>/checkpoints/last.ckpt (or best) of a tlab-train run"


def no_checkpoint(path: object) -> ConfigError:
    """The refusal of a ``ckpt_path`` with nothing there (before torch: ``run.values``; as
    it is loaded: ``run.checkpoints``)."""
    return ConfigError(f"no checkpoint at {path}; {GIVE_CHECKPOINT}")


def check_beam(beam_size: int) -> None:
    """Beam search's one rule (raises ``ValueError``): it keeps at least one beam."""
    if beam_size < 1:
        raise ValueError(
            f"beam_size={beam_size}: beam search keeps at least one beam; give beam_size >= 1"
        )


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Refuse sampling options that draw nothing sensible (raises ``ValueError``)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no cut), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


class DataFileError(RuntimeError):
    """A data file is missing and cannot be downloaded, or fails its checksum."""


class UnknownMetric(ValueError):
    """A metric was asked for that no run logged."""


class UnknownChoice(ValueError):
    """A baseline was asked for that no group of the summary is."""


class RunStopped(Exception):
    """A training run stopped on purpose; ``exit_code`` is the process's exit status."""

    exit_code = 1


class NonFiniteError(RunStopped):
    """The loss, a gradient or a weight became NaN or infinite."""
