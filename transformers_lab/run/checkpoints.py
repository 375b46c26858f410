"""Checkpoints of tlab-train: reading one with a clear error, the step it was saved at,
and refusing one that does not fit the run (its weights, or the config it was trained
with)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from transformers_lab.config import flatten
from transformers_lab.errors import ConfigError
from transformers_lab.run.overrides import override_key

# what a user should give where a checkpoint is asked for
GIVE_CHECKPOINT = "give ckpt_path=<run dir>/checkpoints/last.ckpt (or best) of a tlab-train run"


def checkpoint_file(path: str | Path) -> Path:
    """``path`` if a file is there, else a ``ConfigError`` that says what to give."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}; {GIVE_CHECKPOINT}")
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint as a dict, with a clear error when the file is not there or
    is not a checkpoint."""
    path = checkpoint_file(path)
    try:  # our checkpoints hold configs and tokenizer tables besides tensors
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load fails in many ways on a file that is no checkpoint
        raise ConfigError(f"{path} is not a checkpoint ({exc}); {GIVE_CHECKPOINT}") from exc
    if not isinstance(checkpoint, dict):
        raise ConfigError(
            f"{path} is not a checkpoint (it holds a {type(checkpoint).__name__}); "
            f"{GIVE_CHECKPOINT}"
        )
    return checkpoint


def peek(path: str | Path) -> dict[str, Any] | None:
    """A checkpoint read for its small entries (memory-mapped: its tensors are not read),
    or None if it cannot be read (gone, or not a checkpoint): the callers fall back."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # torch.load fails in many ways on a file that is no checkpoint
        return None
    return checkpoint if isinstance(checkpoint, dict) else None


def checkpoint_step(path: str | Path) -> int | None:
    """The training step a checkpoint was saved at, or None if it cannot be read."""
    step = (peek(path) or {}).get("global_step")
    return None if step is None else int(step)


def checkpoint_time(path: str | Path) -> float:
    """The fitting time a checkpoint's run had spent when it was saved, its earlier
    parts included (what ``safety.Checkpoint`` keeps); 0 where it holds none or cannot
    be read: nothing earlier to count."""
    states = (peek(path) or {}).get("callbacks", {}).values()
    return next((float(s["time_s"]) for s in states if isinstance(s, dict) and "time_s" in s), 0.0)


ABSENT = "(absent)"


def differences(saved: Any, current: Any, allowed: Sequence[str] = ()) -> list[str]:
    """``key: old -> new`` for every dotted key where two plain configs differ, a key that
    one of them lacks shown as ``(absent)``; keys in ``allowed`` (or under them) are left
    out, and a node whose ``_target_`` differs is named by that key alone. A key one side
    lacks and the other leaves null is no difference: an option added to a config later
    with a null default (GPT's ``bottleneck``) does not lock out older checkpoints."""
    old, new = flatten(saved), flatten(current)
    # a node whose class changed is named by its _target_ alone, not by all its options
    swapped = [
        key[: -len("_target_")]
        for key in set(old) & set(new)
        if key.rsplit(".", 1)[-1] == "_target_" and old[key] != new[key]
    ]
    out = []
    for key in sorted(set(old) | set(new)):
        if any(key == a or key.startswith(f"{a}.") for a in allowed):
            continue
        if any(key.startswith(node) and not key.endswith("_target_") for node in swapped):
            continue
        before, after = old.get(key, ABSENT), new.get(key, ABSENT)
        if {shown(before), shown(after)} == {ABSENT, "None"}:
            continue
        if before != after:
            out.append(f"{key}: {shown(before)} -> {shown(after)}")
    return out


def shown(value: Any) -> str:
    return value if value is ABSENT else repr(value)


def check_checkpoint(
    checkpoint: dict[str, Any], module: torch.nn.Module, path: Any, config: dict | None = None
) -> None:
    """Refuse, in one line, a checkpoint whose weights do not fit ``module``; ``config``
    (the sections of ``resolved_sections``) names the options that differ from the
    checkpoint's own."""
    own = module.state_dict()
    saved = checkpoint.get("state_dict", {})
    mismatched = [
        key
        for key in sorted(set(own) | set(saved))
        if key not in own or key not in saved or own[key].shape != saved[key].shape
    ]
    if not mismatched:
        return
    changed = []
    if config is not None and checkpoint.get("tlab_config"):
        changed = differences(checkpoint["tlab_config"], config, RESUME_MAY_CHANGE)
    what = "; ".join(changed) if changed else f"{len(mismatched)} tensors ({mismatched[0]})"
    raise ConfigError(
        f"checkpoint {path} was saved from a different model config ({what}); use the "
        f"model options it was trained with, or drop ckpt_path to start afresh"
    )


# Keys of the saved sections (model, data, task) that a resumed run may change: where the
# data lives and how it is read, how often samples are logged, and which code runs a gated
# kernel's recurrence (the same maths). Every other key of those sections must be as the
# checkpoint says; keys outside them (the trainer's limits, loggers, callbacks, paths,
# seed) may change. ``resume_may_change=[key, ...]`` adds keys.
RESUME_MAY_CHANGE = (
    "data.root",
    "data.download",
    "data.bpe_file",
    "data.num_workers",
    "task.sample_every",
    "task.sample_tokens",
    "model.attention.backend",  # the gated kernels' fla or our chunk loop: one recurrence
)


def check_resume(
    checkpoint: dict[str, Any], config: dict, path: Any, may_change: Sequence[str] = ()
) -> None:
    """Refuse to resume ``checkpoint`` into a run whose model, data or task config (the
    kernel's class and options included) differs from the one it was trained with; the
    one-line error names each key with its old and new value."""
    saved = checkpoint.get("tlab_config") or {}
    old = {k: saved.get(k, {}) for k in config}
    check_may_change(may_change, old, config)
    if not saved:  # not written by tlab-train: only the tensor shapes can be checked
        return
    changed = differences(old, config, (*RESUME_MAY_CHANGE, *may_change))
    if not changed:
        return
    overrides = Path(path).resolve().parent.parent / ".hydra" / "overrides.yaml"
    given = ""
    if overrides.is_file():
        kept = [str(o) for o in OmegaConf.load(overrides) if override_key(str(o)) != "ckpt_path"]
        given = " ".join(kept)
        given = f" (it was trained with: tlab-train {given})" if given else ""
    raise ConfigError(
        f"checkpoint {path} was trained with another config: {'; '.join(changed)}; resume "
        f"with the options it was trained with{given}, list a key in "
        f"resume_may_change=[...] to change it on purpose, or drop ckpt_path to start afresh"
    )


def check_may_change(may_change: Sequence[str], *configs: dict) -> None:
    """Refuse a key of ``resume_may_change`` that is no key (nor section) of the compared
    ``configs``: it would allow nothing, and the change it was meant for would still be
    refused, with the advice to list a key that is listed. The error names the nearest."""
    known = set()
    for config in configs:
        known.update(config)  # the sections, an empty one too
        for key in flatten(config):
            parts = key.split(".")
            known.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for key in may_change:
        if key in known:
            continue
        near = sorted(k for k in known if k.endswith(f".{key}"))
        near = near or difflib.get_close_matches(key, sorted(known), n=3)
        hint = f"did you mean {' or '.join(near)}?" if near else "--cfg job prints them"
        raise ConfigError(
            f"resume_may_change: {key} names no key of the model, data or task config that "
            f"the checkpoint is compared with ({hint}); give each key by its full name there"
        )
