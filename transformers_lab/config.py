"""The configs: where they live, the resolvers they use, composing them from Python (a
group's option: ``compose_option``; a hybrid stack's layers: ``expand_hybrid``), a node's
instantiation refused in the words of its target rather than Hydra's wrapping of them
(``instantiation_refusals``), a ``_target_`` that moved followed to its new home
(``MOVED``: a config of an earlier version keeps working).

The resolvers are registered on import; every entry point imports this module (through
``run.components``)."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import os
import re
import secrets
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from transformers_lab.errors import ConfigError

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def optuna_direction(mode: str) -> str:
    """``${optuna_direction:${monitor.mode}}``: min/max as Optuna's minimize/maximize."""
    directions = {"min": "minimize", "max": "maximize"}
    if mode not in directions:
        raise ConfigError(f"monitor.mode must be min or max, got {mode!r}")
    return directions[mode]


def run_id() -> str:
    """``${run_id:}``: 6 random hex digits, drawn once per config (the resolver is cached),
    so two runs that start in the same microsecond still get different run dirs."""
    return secrets.token_hex(3)


def srun_task() -> tuple[str, int] | None:
    """Under ``srun`` with several tasks (a DDP job that SLURM starts, one task a device):
    the step's name, ``<job>.<step>``, the same in every task and in the job SLURM runs
    again after a requeue, and this task's rank; None otherwise."""
    env = os.environ
    # srun's own variables: a batch script's commands (no srun) share neither
    keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID")
    if not all(env.get(k, "").isdigit() for k in keys) or int(env["SLURM_STEP_NUM_TASKS"]) <= 1:
        return None
    return f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}", int(env["SLURM_PROCID"])


def run_stamp(name: str) -> str:
    """``${run_stamp:<name>}``: a run dir's ``name`` (its start time and ``run_id``); in a
    task of a several-task ``srun``, ``slurm-<job>.<step>``: one dir for all the tasks,
    found again when SLURM requeues the job (``run.job`` resumes it)."""
    task = srun_task()
    return name if task is None else f"slurm-{task[0]}"


def hydra_subdir() -> str:
    """``${hydra_subdir:}``: where Hydra writes the composed config in the run dir:
    ``.hydra``; ``.hydra.rank<k>`` for the other tasks of a several-task ``srun``, as
    Lightning's own launcher does for the processes it starts."""
    task = srun_task()
    return ".hydra" if task is None or task[1] == 0 else f".hydra.rank{task[1]}"


def epoch_steps(epochs: int, examples: int, batch_size: int) -> int:
    """``${epoch_steps:64,${data.train_examples},${data.batch_size}}``: the optimizer steps
    of ``epochs`` epochs on one device (a schedule's horizon given in epochs, as Zoology's
    cosine over 64 epochs, when the run itself may be shorter)."""
    if min(epochs, examples, batch_size) < 1:
        raise ConfigError(
            f"epoch_steps needs positive epochs, examples and batch size, got {epochs}, "
            f"{examples} and {batch_size}"
        )
    return epochs * math.ceil(examples / batch_size)


OmegaConf.register_new_resolver("optuna_direction", optuna_direction, replace=True)
OmegaConf.register_new_resolver("epoch_steps", epoch_steps, replace=True)


def multiples(base: int, factors: list[Any]) -> list[int]:
    """``${multiples:${data.block_size},[1,2,4,8]}``: the lengths an evaluation past the
    trained length scores at, as multiples of it."""
    return [int(base * f) for f in factors]


OmegaConf.register_new_resolver("multiples", multiples, replace=True)


OmegaConf.register_new_resolver("run_id", run_id, use_cache=True, replace=True)
OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)
OmegaConf.register_new_resolver("hydra_subdir", hydra_subdir, use_cache=True, replace=True)


@contextlib.contextmanager
def instantiation_refusals(what: str) -> Iterator[None]:
    """Hydra's ``instantiate`` of the node at ``what`` (``data``, ``callbacks.<name>``)
    inside, its failure as one ``ConfigError`` in the target's own words, not Hydra's
    wrapping of them: a ``_target_`` that cannot be imported (an earlier version's was
    followed to its new home before: ``MOVED``), an optional package the choice needs,
    Lightning's refusal, the constructor's own ``ValueError`` or ``TypeError``."""
    from hydra.errors import InstantiationException

    try:
        yield
    except InstantiationException as exc:
        raise instantiation_refusal(exc, what) from exc


def instantiation_refusal(exc: Exception, what: str) -> ConfigError:
    """The one line of ``instantiation_refusals`` for Hydra's ``exc``."""
    cause = exc.__cause__
    if str(exc).startswith("Error locating target"):  # an import path that is not there
        # Hydra names the target and, for a nested node, its key (full_key: attention)
        named = re.match(r"Error locating target '([^']+)'", str(exc))
        target = named[1] if named else "?"
        nested = re.search(r"full_key: ([\w.]+)", str(exc))
        key = nested[1] if nested else ""
        where = key if key.startswith(f"{what}.") else f"{what}.{key}" if key else what
        why = str(cause).strip().splitlines()[-1] if cause else ""  # Hydra's question
        return ConfigError(
            f"{where}: cannot import its _target_ {target!r}: {why} Give the dotted path "
            "of a class or function that exists, its package importable"
        )
    if isinstance(cause, ImportError):  # an optional package the choice needs
        return ConfigError(f"{what}: {cause}")
    # Lightning's own refusal: only a target that imported Lightning raises it, so this
    # module leaves it unimported (10 s of imports for each bench worker and tool)
    lightning = sys.modules.get("lightning.fabric.utilities.exceptions")  # pytorch's too
    if lightning and isinstance(cause, lightning.MisconfigurationException):
        return ConfigError(f"{what}: Lightning refused it: {cause}")
    if isinstance(cause, ValueError | TypeError | FileNotFoundError | RuntimeError):
        return ConfigError(f"{what}: {cause}")
    return ConfigError(f"{what}: {exc}")


def compose_config(name: str, overrides: list[str], output_dir: str | Path) -> DictConfig:
    """The config that ``tlab-<name> <overrides>`` would run, writing into ``output_dir``,
    for running the entry points from Python (benchmarks, notebooks, tests). Hydra's own
    interpolations (``${hydra:...}``) resolve as in a real run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    output_dir = Path(output_dir)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)
        cfg.hydra.runtime.cwd = str(output_dir.parent)
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    return cfg


@contextlib.contextmanager
def composing() -> Iterator[None]:
    """Hydra's compose API ready for ``compose_option``: as it is inside a running app (a
    hybrid stack's layer, named while the run is built), else initialized on ``conf/``
    for the duration (one initialization for many compositions)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def compose_option(group: str, name: str, dirs: Sequence[Path] = (CONF_DIR,)) -> dict[str, Any]:
    """The option ``name`` of ``group`` (``attention``, or ``mixer``) as ``<group>=<name>``
    composes it with ``dirs`` on the search path (its defaults applied), a plain dict
    with ``_target_`` and the layer's switches left at their defaults dropped."""
    from hydra import compose

    override = f"attention={name}" if group == "attention" else f"+{group}={name}"
    with composing():
        cfg = compose("train", overrides=[override, *searchpath_override(dirs)])
    return without_default_parts(OmegaConf.to_container(cfg[group], resolve=True))


def attention_configs(
    dirs: Sequence[Path] = (CONF_DIR,), names: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """The options ``names`` (default: every one) of the ``attention`` group in ``dirs``
    (``conf/`` and the user's config dirs), each composed (``compose_option``), by name;
    those of ``conf/`` alone are composed once a process (its files do not change while
    it runs), each call given its own copy."""
    names = group_options("attention", dirs) if names is None else names
    if [Path(d) for d in dirs] == [CONF_DIR]:
        return {name: copy.deepcopy(packaged_option(name)) for name in names}
    with composing():
        return {name: compose_option("attention", name, dirs) for name in names}


@functools.cache
def packaged_option(name: str) -> dict[str, Any]:
    """An option of ``conf/attention``, composed (``compose_option``), once a process."""
    return compose_option("attention", name)


def layer_part_defaults() -> dict[str, Any]:
    """The layer's switches that every attention option composes with, at their defaults
    (off): ``conf/layer/parts.yaml``; the layer's own are ``nn.parts.LayerParts``."""
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "layer" / "parts.yaml"))


def without_default_parts(config: dict[str, Any]) -> dict[str, Any]:
    """An attention config without the layer switches left at their defaults: the config
    its yaml gives."""
    default = layer_part_defaults()
    return {k: v for k, v in config.items() if k not in default or v != default[k]}


def run_search_dirs() -> list[Path]:
    """``conf/`` and the config dirs of the running job: those on its ``hydra.searchpath``
    (the command line's, a sweep's or a composed config's) and its other file config
    sources (``--config-dir``); ``conf/`` alone outside a job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return [CONF_DIR]
    hydra_cfg = HydraConfig.get()
    entries = list(hydra_cfg.searchpath or [])
    found = search_dirs([f"hydra.searchpath=[{','.join(entries)}]"] if entries else [])
    sources = hydra_cfg.runtime.get("config_sources") or []  # --config-dir's too
    given = [Path(s.path) for s in sources if s.get("schema") == "file" and s.get("path")]
    return list(dict.fromkeys([*(found or [CONF_DIR]), *given]))


def searchpath_override(dirs: Sequence[Path]) -> list[str]:
    """The override that puts the user's config dirs among ``dirs`` on Hydra's search
    path (none if there are none)."""
    extra = [f"file://{d}" for d in dirs if Path(d) != CONF_DIR]
    return [f"hydra.searchpath=[{','.join(extra)}]"] if extra else []


def group_options(group: str, dirs: Sequence[Path] = (CONF_DIR,)) -> list[str]:
    """The options of a config group: the ``.yaml`` files in ``<dir>/<group>/`` of each of
    ``dirs`` (``conf/`` and the user's config dirs)."""
    return sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})


def unknown_option(group: str, choice: str, dirs: Sequence[Path] = (CONF_DIR,)) -> ConfigError:
    """The error for an option that no config dir has in ``group``."""
    where = ", ".join(f"conf/{group}/" if d == CONF_DIR else str(d / group) + "/" for d in dirs)
    return ConfigError(
        f"unknown {group} {choice!r}; valid options are: "
        f"{', '.join(group_options(group, dirs))} ({where})"
    )


def search_dirs(argv: Sequence[str]) -> list[Path] | None:
    """``conf/`` and the config dirs the command line adds (``hydra.searchpath=[...]``
    entries ``file://<dir>`` or ``pkg://<package>``, ``--config-dir``); None when one of
    them cannot be found from here (Hydra will say)."""
    dirs = [CONF_DIR]
    entries: list[str] = []
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key.lstrip("+") == "hydra.searchpath" and eq:
            entries += [e.strip().strip("'\"") for e in value.strip("[]").split(",") if e.strip()]
        elif key in ("--config-dir", "-cd"):
            entries.append(value if eq else (argv[i + 1] if i + 1 < len(argv) else ""))
    for entry in entries:
        scheme, sep, rest = entry.partition("://")
        if not sep:
            scheme, rest = "file", entry
        if scheme == "file":
            dirs.append(Path(rest))
        elif scheme == "pkg":
            package, _, sub = rest.partition("/")
            try:
                spec = importlib.util.find_spec(package)
            except (ImportError, ValueError):
                return None
            if spec is None or not spec.submodule_search_locations:
                return None
            dirs.append(Path(next(iter(spec.submodule_search_locations))) / sub)
        else:
            return None
    return dirs


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """The leaves of a nested plain config as ``{"model.attention.p": 2, ...}`` (lists are
    leaves, empty sections have none)."""
    if not isinstance(config, dict):
        return {prefix[:-1]: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def layer_config(name: str, dirs: Sequence[Path] | None = None) -> dict[str, Any]:
    """The config of a hybrid stack's layer ``name`` (``model.hybrid``): an option of the
    attention group, composed as ``attention=<name>`` would be, or of the mixer group
    (``base_conv``), found in and composed with ``dirs``: by default ``conf/`` and the
    config dirs of the run's ``hydra.searchpath`` (``run_search_dirs``), the user's own."""
    dirs = run_search_dirs() if dirs is None else list(dirs)
    options = {g: group_options(g, dirs) for g in ("attention", "mixer")}
    if name not in options["attention"] and name not in options["mixer"]:
        valid = ["attention", *options["attention"], *options["mixer"]]
        raise ConfigError(
            f"model.hybrid: unknown layer {name!r}; valid ones are: {', '.join(valid)} "
            "(attention: the model's own attention config; a kernel of your own config dir "
            "needs hydra.searchpath=[file://DIR])"
        )
    return compose_option("attention" if name in options["attention"] else "mixer", name, dirs)


def expand_hybrid(model: DictConfig, dirs: Sequence[Path] | None = None) -> DictConfig:
    """The model config with each layer named in ``model.hybrid`` replaced by its config
    (``layer_config``); ``attention`` stays, the model's own. Unchanged without a hybrid."""
    hybrid = model.get("hybrid") if isinstance(model, DictConfig) else None
    if hybrid is None:
        return model
    cache: dict[str, Any] = {}

    def resolve(choice: Any) -> Any:
        if not isinstance(choice, str) or choice == "attention":
            return choice
        if choice not in cache:
            cache[choice] = layer_config(choice, dirs)
        return cache[choice]

    plain = OmegaConf.to_container(hybrid, resolve=True)
    if isinstance(plain, dict):
        expanded: Any = {k: resolve(v) for k, v in plain.items()}
    elif isinstance(plain, list):
        expanded = [resolve(v) for v in plain]
    else:
        raise ConfigError(
            f"model.hybrid must be a list of layer choices ([base_conv,based]) or a mapping "
            f"{{layer: choice}} ({{2: softmax}}), got {plain!r}"
        )
    plain_model = OmegaConf.to_container(model, resolve=True)
    plain_model["hybrid"] = expanded
    return OmegaConf.create(plain_model)


def option_classes(group: str) -> list[tuple[str, type]]:
    """(option, class) of every ``conf/<group>/*.yaml`` that names a class: its
    ``_target_`` at the top, or under ``<group>:`` (a ``@package _global_`` file); options
    that only pick another (``conf/task/gpt.yaml``) are left out."""
    from hydra.utils import get_object

    found = []
    for path in sorted(CONF_DIR.glob(f"{group}/*.yaml")):
        loaded = OmegaConf.load(path)
        node = loaded if "_target_" in loaded else loaded.get(group)
        if not (isinstance(node, DictConfig) and "_target_" in node):
            continue
        try:
            found.append((path.stem, get_object(str(node._target_))))
        except (AttributeError, ImportError, ValueError):  # pragma: no cover - broken file
            continue
    return found


def data_compatible_models(provided: set[str]) -> list[str]:
    """The model options in ``conf/model`` whose class takes every key in ``provided`` and
    needs no other size (an encoder classifier takes a language model's data's keys, but
    its classes come from classification data)."""
    fits = []
    for name, cls in option_classes("model"):
        params = inspect.signature(cls).parameters
        needs = {
            key
            for key, p in params.items()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        if provided <= set(params) and needs <= provided:
            fits.append(name)
    return fits


# classes and functions that moved: (old prefix, new prefix) of a ``_target_``
MOVED = (
    ("transformers_lab.run.safety.Checkpoint", "transformers_lab.run.checkpoints.Checkpoint"),
    (
        "transformers_lab.run.safety.AtomicCheckpointIO",
        "transformers_lab.run.checkpoints.AtomicCheckpointIO",
    ),
    ("transformers_lab.run.safety.", "transformers_lab.run.callbacks.safety."),
    ("transformers_lab.callbacks.", "transformers_lab.run.callbacks.views."),
    ("transformers_lab.loggers.", "transformers_lab.run.loggers."),
    ("transformers_lab.nn.attention.", "transformers_lab.nn.multihead."),
    ("transformers_lab.attention.elu.", "transformers_lab.attention.linear."),
)


def moved_target(target: Any) -> str | None:
    """Where a ``_target_`` of an earlier version lives now, or None if it did not move."""
    for old, new in MOVED if isinstance(target, str) else ():
        if target.startswith(old):
            return new + target[len(old) :]
    return None


def moved_targets(node: Any) -> list[tuple[str, str]]:
    """Point, in place, every ``_target_`` of a config that moved (``MOVED``) to its new
    home; returns each (old, new) pair. A plain config (a checkpoint's) and an OmegaConf
    one (a run's, its interpolations left unresolved) alike."""
    keys: list[Any] = []
    if isinstance(node, dict | DictConfig):
        keys = list(node)
        children = [node._get_node(k) if isinstance(node, DictConfig) else node[k] for k in keys]
    elif isinstance(node, list | ListConfig):
        children = [node._get_node(i) if isinstance(node, ListConfig) else node[i]
                    for i in range(len(node))]  # fmt: skip
    else:
        return []
    moved = []
    if "_target_" in keys:
        target = children[keys.index("_target_")]
        old = target._value() if isinstance(node, DictConfig) else target
        if (new := moved_target(old)) is not None:
            moved.append((old, new))
            with open_dict(node) if isinstance(node, DictConfig) else contextlib.nullcontext():
                node["_target_"] = new
    for child in children:
        moved.extend(moved_targets(child))
    return moved


def migrate_targets(config: Any) -> None:
    """``moved_targets`` with a note for each that names both: a config of an earlier
    version keeps working."""
    for old, new in moved_targets(config):
        log.warning("%s moved to %s; update your config", old, new)
