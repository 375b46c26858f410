"""What each run of a summary ran, read from its composed config rather than from the text
of its command line: a run given ``attention=softmax`` and a run that got softmax by
default ran the same thing, and are one group.

A run's dir holds ``.hydra/config.yaml`` (every setting, as composed) and
``.hydra/hydra.yaml`` (the option chosen in each config group). Over a set of runs:

- the runs' **identity** is their settings that differ from run to run, seeds and
  bookkeeping aside: two runs with the same settings are one group, whatever their
  command lines said;
- their **labels** name that difference as a researcher would: by the config group whose
  option changed (``attention=fastmax_p2``, not the ``attention.p`` it brings), and by the
  settings that no such group explains or that the command lines set themselves
  (``optimizer.lr=0.001``).

A run without ``.hydra/`` (a record copied on its own) is read from its overrides.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

from transformers_lab.config import flatten
from transformers_lab.run.overrides import MACHINE_KEYS, SEED_KEYS, bookkeeping, override_map

# settings that say where and how a run is logged or launched, not what it computes
# (and ``bookkeeping``'s: the progress bar, what the summary does)
IGNORED_SETTINGS = ("paths.", "logger.", "hydra.", "tags", "task_name", "run_name", *MACHINE_KEYS)
# config groups that place or launch a run, or are presets whose settings speak for them
IGNORED_GROUPS = ("hydra", "paths", "logger", "launcher", "sweep")


def read_settings(run_dir: Path) -> tuple[dict[str, str], dict[str, str]] | None:
    """A run's settings (``optimizer.lr -> 0.001``, every leaf of its composed config, as
    written: interpolations unresolved) and its groups' options (``attention -> softmax``),
    or None where its dir has no composed config (or no record of the options)."""
    config_file, hydra_file = run_dir / ".hydra" / "config.yaml", run_dir / ".hydra" / "hydra.yaml"
    if not (config_file.is_file() and hydra_file.is_file()):
        return None
    choices = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.choices")
    if choices is None:
        return None
    config = OmegaConf.to_container(OmegaConf.load(config_file), resolve=False)
    settings = {
        key: str(value)
        for key, value in flatten(config).items()
        if not key.startswith(IGNORED_SETTINGS) and not bookkeeping(key)
    }
    options = {
        str(group): str(option)
        for group, option in choices.items()
        if str(group).split("/")[0] not in IGNORED_GROUPS
    }
    return settings, options


def labelled_values(
    runs: Sequence[tuple[list[str], Path | None]],
) -> list[tuple[dict[str, str], dict[str, str] | None]]:
    """For each run (its overrides, and its dir if it has one) the values that tell it
    from the others: its seed, the groups whose option changed, the settings that no such
    group explains; and its identity, its changed settings in full (seeds aside), where
    every run has a composed config. Runs without one are read from their overrides alone
    (identity None)."""
    read = [read_settings(d) if d is not None else None for _, d in runs]
    if not runs or any(r is None for r in read):
        return [(override_map(overrides), None) for overrides, _ in runs]
    settings = [s for s, _ in read]  # type: ignore[misc]
    options = [o for _, o in read]  # type: ignore[misc]
    changed = varying(settings, skip=SEED_KEYS)
    groups = varying(options)
    given = {key for overrides, _ in runs for key in override_map(overrides)}
    explained = {  # a setting swept by hand is shown, whatever else changed with it
        key
        for key in changed
        if key not in given and any(determines(options, settings, g, key) for g in groups)
    }
    # what the command lines set by hand is named too, changed or not (a grid's PANELS key
    # with one value): a group by its option, a setting by its value
    named_groups = sorted(set(groups) | {k for k in given if any(k in o for o in options)})
    named = sorted(
        {k for k in changed if k not in explained}
        | {k for k in given if k not in named_groups and any(k in x for x in settings)}
    )
    values = []
    for s, o in zip(settings, options, strict=True):
        own = {k: s[k] for k in SEED_KEYS if k in s}
        own.update({g: o.get(g, "null") for g in named_groups})
        own.update({k: s.get(k, "null") for k in named})
        values.append((own, {k: s.get(k, "null") for k in changed}))
    return values


def varying(maps: Sequence[dict[str, str]], skip: Sequence[str] = ()) -> list[str]:
    """The keys whose value (or presence) differs between the maps, ``skip`` aside."""
    keys = sorted({k for m in maps for k in m} - set(skip))
    return [k for k in keys if len({m.get(k) for m in maps}) > 1]


def determines(
    options: Sequence[dict[str, str]], settings: Sequence[dict[str, str]], group: str, key: str
) -> bool:
    """Whether the option of ``group`` fixes the setting ``key``: runs with one option of
    the group all have one value of the key."""
    seen: dict[str, str | None] = {}
    for o, s in zip(options, settings, strict=True):
        if seen.setdefault(o.get(group, "null"), s.get(key)) != s.get(key):
            return False
    return True
