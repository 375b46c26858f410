"""A checkpoint held to the run it is given to: what a run resumes (``resume_from``: the
checkpoint read, its config against this run's, ``check_resume``, keys that may change
listed) and its weights against the model built (``check_weights``)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from transformers_lab.config import flatten
from transformers_lab.errors import ConfigError
from transformers_lab.run.checkpoints.saved import (
    SavedCheckpoint,
    read_checkpoint,
    resolved_sections,
)
from transformers_lab.run.overrides import override_key

ABSENT = "(absent)"  # a key one of two configs lacks, as a difference shows it


def differences(saved: Any, current: Any, allowed: Sequence[str] = ()) -> list[str]:
    """``key: old -> new`` for every dotted key where two plain configs differ, a key that
    one of them lacks shown as ``(absent)``; keys in ``allowed`` (or under them) are left
    out, and a node whose ``_target_`` differs is named by that key alone. A key one side
    lacks and the other leaves null, or sets to the default of the class its node builds,
    is no difference: an option added to a config later (GPT's ``bottleneck``, an image
    data set's ``as_sequence: false``) does not lock out older checkpoints."""
    return flat_differences(flatten(saved), flatten(current), allowed)


def constructor_default(flat: dict[str, Any], key: str) -> Any:
    """The default of ``key``'s parameter in the class its node's ``_target_`` names
    (``ABSENT`` where there is none, or the class cannot be found)."""
    node, _, name = key.rpartition(".")
    target = flat.get(f"{node}._target_" if node else "_target_")
    if not isinstance(target, str):
        return ABSENT
    from hydra.utils import get_object

    try:
        param = inspect.signature(get_object(target))
    except (ImportError, AttributeError, TypeError, ValueError):
        return ABSENT
    found = param.parameters.get(name)
    return ABSENT if found is None or found.default is found.empty else found.default


def flat_differences(
    old: dict[str, Any], new: dict[str, Any], allowed: Sequence[str] = ()
) -> list[str]:
    """``differences`` of two configs given as their leaves (``config.flatten``)."""
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
        if {said(before), said(after)} == {ABSENT, "None"}:
            continue
        if ABSENT in (before, after):  # the side that has it gives the class's default
            side = new if before is ABSENT else old
            default = constructor_default(side, key)
            if default is not ABSENT and side[key] == default:
                continue
        if before != after:
            out.append(f"{key}: {said(before)} -> {said(after)}")
    return out


def said(value: Any) -> str:
    """A config value as a difference shows it: ``repr``, or ``(absent)``."""
    return value if value is ABSENT else repr(value)


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
    "data.cache_dir",
    "data.prepared_dir",  # a corpus's shards: where they are, and how many make them
    "data.prepare_workers",
    "task.sample_every",
    "task.sample_tokens",
    "model.attention.backend",  # the gated kernels' fla or our chunk loop: one recurrence
    "model.activation_checkpointing",  # recomputed or kept: the same gradients
)


def check_resume(
    checkpoint: SavedCheckpoint, config: dict, may_change: Sequence[str] = ()
) -> list[str]:
    """Refuse to resume ``checkpoint`` into a run whose model, data or task config (the
    kernel's class and options included) differs from the one it was trained with; the
    one-line error names each key with its old and new value. Returns the changes that
    ``may_change`` allowed (``key: old -> new``), for ``check_weights`` to name."""
    saved, path = checkpoint.config, checkpoint.path
    old, new = flatten({k: saved.get(k, {}) for k in config}), flatten(config)
    check_may_change(may_change, config, old, new)
    if not saved:  # not written by tlab-train: only the tensor shapes can be checked
        return []
    changed = flat_differences(old, new, (*RESUME_MAY_CHANGE, *may_change))
    if not changed:
        return flat_differences(old, new, RESUME_MAY_CHANGE)
    overrides = checkpoint.run_dir / ".hydra" / "overrides.yaml"
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


def check_may_change(
    may_change: Sequence[str], sections: Iterable[str], *leaves: dict[str, Any]
) -> None:
    """Refuse a key of ``resume_may_change`` that is no key (nor section) of the compared
    configs (their ``sections`` and ``leaves``, as ``config.flatten`` gives them): it
    would allow nothing, and the change it was meant for would still be refused, with the
    advice to list a key that is listed. The error names the nearest."""
    known = set(sections)  # an empty one too
    for keys in leaves:
        for key in keys:
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


def check_weights(
    checkpoint: SavedCheckpoint,
    module: torch.nn.Module,
    changed: Sequence[str] = (),
    against: Any = None,
) -> None:
    """Refuse, in one line, a checkpoint whose weights do not fit ``module``, naming the
    options ``changed`` from its own (``key: old -> new``, as ``check_resume`` returns
    them; or those of the config ``against``, the run rebuilt), else the tensors that
    differ."""
    own, saved = module.state_dict(), checkpoint.shapes
    mismatched = [
        key
        for key in sorted(set(own) | set(saved))
        if key not in own or key not in saved or own[key].shape != saved[key]
    ]
    if not mismatched:
        return
    if against is not None:
        changed = differences(checkpoint.config, resolved_sections(against))
    what = "; ".join(changed) if changed else f"{len(mismatched)} tensors ({mismatched[0]})"
    raise ConfigError(
        f"checkpoint {checkpoint.path} was saved from a different model config ({what}); use "
        f"the model options it was trained with, or drop ckpt_path to start afresh"
    )


class Resume(NamedTuple):
    """A run's resolved model, data and task config (``run_config``: what its checkpoints
    keep), and the checkpoint it resumes (None: it starts afresh) with the changes from
    the checkpoint's config that ``resume_may_change`` allowed (or the config to find
    them in, ``against``, where its weights do not fit)."""

    run_config: dict[str, Any]
    checkpoint: SavedCheckpoint | None = None
    changed: list[str] = []
    against: Any = None

    def check_weights(self, module: torch.nn.Module) -> None:
        """The checkpoint's weights held to ``module`` (nothing without a checkpoint)."""
        if self.checkpoint is not None:
            check_weights(self.checkpoint, module, self.changed, self.against)


def resume_from(cfg: DictConfig, checkpoint: SavedCheckpoint | None = None) -> Resume:
    """What a run resumes: ``cfg.ckpt_path`` (``checkpoint`` when the job read it already;
    else read here, ``trust_checkpoint`` letting it hold more than tensors and plain
    values), its config held to the run's (``check_resume``), before any data is read."""
    run_config = resolved_sections(cfg)
    if not cfg.get("ckpt_path"):
        return Resume(run_config)
    if checkpoint is None:
        checkpoint = read_checkpoint(cfg.ckpt_path, bool(cfg.get("trust_checkpoint")))
    changed = check_resume(checkpoint, run_config, cfg.get("resume_may_change") or ())
    return Resume(run_config, checkpoint, changed)
