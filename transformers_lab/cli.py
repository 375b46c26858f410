"""What the entry points share: checking the command line before Hydra composes (group
options, the folder of the run dir), and reporting a user's mistake as one line instead
of a traceback."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hydra.errors import CompactHydraException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, InterpolationResolutionError

from transformers_lab.config import CONF_DIR, flatten, group_options, search_dirs, unknown_option
from transformers_lab.errors import ConfigError, DataFileError

# values that are Hydra sweep functions or special, not option names
SWEEP_FUNCTION = re.compile(r"^\w+\(.*\)$")
# flags after which Hydra prints something and exits without creating a run dir
INFO_FLAGS = {"-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc"}


def check_overrides(argv: Sequence[str]) -> None:
    """Refuse ``group=option`` overrides whose option exists in no config dir, listing
    the valid ones (Hydra would print its search path and a hint to set
    HYDRA_FULL_ERROR). The user's config dirs on ``hydra.searchpath`` count."""
    dirs = search_dirs(argv)
    if dirs is None:
        return
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~").split("@")[0]
        if key.startswith("hydra") or "." in key or not any((d / key).is_dir() for d in dirs):
            continue
        if SWEEP_FUNCTION.match(value):
            continue
        for choice in value.strip("[]").split(","):  # a sweep (a,b) or a list ([a,b])
            choice = choice.strip()
            if choice in ("null", "") or any((d / key / f"{choice}.yaml").is_file() for d in dirs):
                continue
            raise unknown_option(key, choice, dirs)


def keys_named(name: str) -> list[str]:
    """The dotted config keys whose last part is ``name``, as the files of ``conf/`` set
    them (a group's file sets keys under the group's name unless it is ``_global_``), the
    most often set first."""
    counts: dict[str, int] = {}
    for path in sorted(CONF_DIR.rglob("*.yaml")):
        parts = path.relative_to(CONF_DIR).parts[:-1]
        text = path.read_text()
        prefix = "" if "@package _global_" in text else "".join(f"{p}." for p in parts)
        config = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
        for key in flatten(config if isinstance(config, dict) else {}):
            if key.rsplit(".", 1)[-1] == name and not key.startswith(("defaults", "hydra.")):
                counts[prefix + key] = counts.get(prefix + key, 0) + 1
    return sorted(counts, key=lambda k: (-counts[k], k))


def check_flags(argv: Sequence[str]) -> None:
    """Refuse ``--name value`` options that Hydra does not have (argparse would print its
    usage), naming the ``key=value`` override meant."""
    from hydra._internal.utils import get_args_parser

    known = set(get_args_parser()._option_string_actions)
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not flag.startswith("-") or flag in known or flag == "-":
            continue
        if not eq and i + 1 < len(argv) and "=" not in argv[i + 1]:
            value = argv[i + 1] if not argv[i + 1].startswith("-") else ""
        keys = keys_named(flag.lstrip("-").replace("-", "_"))
        meant = " or ".join(f"{k}={value or '...'}" for k in keys[:3])
        hint = f"write {meant}" if keys else "write key=value (--cfg job prints every key)"
        raise ConfigError(
            f"unknown option {flag}: settings are Hydra overrides key=value, not --options; {hint}"
        )


def run_dir_folder(argv: Sequence[str]) -> Path | None:
    """The run dir (or the folder it goes in) as the command line and ``$TLAB_ROOT`` set
    it (conf/paths/default.yaml, conf/hydra/default.yaml), up to its first interpolation;
    None where only composing can tell."""
    overrides = {}
    for arg in argv:
        if "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            overrides[key.lstrip("+")] = value
    run_dir = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
    if run_dir in overrides:
        value = overrides[run_dir]
    elif "paths.log_dir" in overrides:
        value = overrides["paths.log_dir"]
    else:
        value = overrides.get("paths.root_dir", os.environ.get("TLAB_ROOT", ".")) + "/logs"
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]  # Hydra's quoted value (how Lightning passes it to DDP processes)
    if value.startswith("${"):
        return None
    literal, interpolation, _ = value.partition("${")
    return Path(os.path.dirname(literal) if interpolation else literal)


def check_run_dir(argv: Sequence[str]) -> None:
    """Refuse a run dir that cannot be created, before Hydra fails on it with a traceback."""
    folder = None if INFO_FLAGS & set(argv) else run_dir_folder(argv)
    if folder is None:
        return
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as exc:
        raise ConfigError(
            f"cannot create the run dir in {folder}: {existing} is not a folder that can be "
            f"written ({exc.strerror}); point TLAB_ROOT, paths.root_dir= or hydra.run.dir= "
            f"(hydra.sweep.dir= with -m) at a writable folder"
        ) from None


# keys that were renamed: an old command line runs with the new name, and is told it
RENAMED = {
    "data.seq_len": "data.block_size",
    "data.task": "data.problem",
    "model.max_len": "model.block_size",  # the context has one name: Transformer, Encoder
    "data.max_len": "data.block_size",  # and the translation data
    "max_len": "max_new_tokens",  # tlab-translate: the tokens it writes, as tlab-sample names it
}


def renamed(argv: Sequence[str]) -> list[str]:
    """``argv`` with each renamed key (``RENAMED``) under its new name, said on stderr:
    ``data.seq_len=64`` runs as ``data.block_size=64``, a sweep's values too."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        bare = key.lstrip("+~")
        if eq and bare in RENAMED:
            new = RENAMED[bare]
            print(f"note: {bare} is now called {new}; running with {new}={value}", file=sys.stderr)
            arg = f"{key[: len(key) - len(bare)]}{new}={value}"
        out.append(arg)
    return out


def one_line(exc: Exception) -> str:
    """A config error of Hydra or OmegaConf, said briefly; a mistyped key gets the nearest."""
    cause = exc.__cause__
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and cause.parent_node is not None:
        if cause.full_key in RENAMED:
            new = RENAMED[cause.full_key]
            return f"{cause.full_key} is now called {new}: give {new}=... instead"
        parent, _, key = cause.full_key.rpartition(".")
        near = difflib.get_close_matches(key, [str(k) for k in cause.parent_node], n=1)
        if near and not parent and (CONF_DIR / near[0]).is_dir():  # a misspelled group
            return (
                f"unknown key {key} (did you mean the config group {near[0]}? "
                f"{near[0]}=<option>, one of: {', '.join(group_options(near[0]))})"
            )
        hint = f" (did you mean {'.'.join(filter(None, (parent, *near)))}?)" if near else ""
        return (
            f"unknown key {cause.full_key}{hint}; a new key needs a leading +: "
            f"+{cause.full_key}=... (--cfg job prints the config)"
        )
    if isinstance(exc, InterpolationResolutionError):
        where = exc.full_key or "an interpolation"
        return f"cannot resolve {where}: {str(exc).splitlines()[0]}"
    return str(exc).split("Config search path:")[0]


def fail(message: str) -> None:
    """Print ``error: <message>`` on one line of stderr and exit with code 2."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn configuration, missing-data and file-system errors into one line on stderr
    and exit 2."""
    try:
        yield
    except (ConfigError, DataFileError) as exc:
        fail(str(exc))
    except InterpolationResolutionError as exc:
        fail(one_line(exc))
    except OSError as exc:  # the environment: a path, its permissions, the disk
        fail(file_error(exc))


def file_error(exc: OSError) -> str:
    """An error of the file system, said as what could not be done where, and why."""
    where = f" {exc.filename}" if exc.filename else ""
    return (
        f"cannot use{where}: {exc.strerror or exc}; check that the path exists and can be "
        "written, and that the disk has room (run dirs: TLAB_ROOT or hydra.run.dir=; data: "
        "TLAB_DATA_DIR or data.root=)"
    )


# what a run writes into its dir before it trains a step: Hydra's config and log, the
# job's record, its loggers' folders (no checkpoint)
FRESH_RUN_FILES = (".hydra", "result.json", "csv", "tensorboard", "wandb")


@contextlib.contextmanager
def refusals_leave_no_run_dir() -> Iterator[None]:
    """A single run refused (a ``ConfigError``, a ``DataFileError``, an interpolation that
    fails) takes its run dir away with it, where the dir holds nothing but what a run
    writes before it trains (``FRESH_RUN_FILES``, its log; no checkpoint): a mistake
    leaves nothing to clear up, and a dir that a run used before is kept whole."""
    try:
        yield
    except (ConfigError, DataFileError, InterpolationResolutionError):
        remove_fresh_run_dir()
        raise


def remove_fresh_run_dir() -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return  # a sweep's job dir records its failure
    out = Path(HydraConfig.get().runtime.output_dir)
    entries = list(out.iterdir()) if out.is_dir() else []
    if not entries or not all(p.name in FRESH_RUN_FILES or p.suffix == ".log" for p in entries):
        return
    for entry in entries:
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    out.rmdir()


@contextlib.contextmanager
def hydra_raising() -> Iterator[None]:
    """Have Hydra raise its errors (``HYDRA_FULL_ERROR``) instead of printing them."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


def run_hydra(main: Callable[[], None], argv: Sequence[str] | None = None) -> None:
    """Check the command line, then hand over to a ``@hydra.main``; Hydra's own errors (a
    mistyped key, bad syntax, an interpolation that fails) are reported in one line too."""
    if argv is None:  # Hydra reads sys.argv: the new names go there
        sys.argv[1:] = renamed(sys.argv[1:])
        argv = sys.argv[1:]
    else:
        argv = renamed(argv)
    with user_errors():
        check_flags(argv)
        check_overrides(argv)
        check_run_dir(argv)
    try:
        with user_errors(), hydra_raising():  # user_errors: what a sweeper refuses, too
            main()
    except (CompactHydraException, InterpolationResolutionError) as exc:
        fail(one_line(exc))
