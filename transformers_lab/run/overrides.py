"""The one reader of Hydra overrides (``key=value`` on a command line or in a job's
``overrides.yaml``), and what they say about a job's identity."""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

SEED_KEYS = ("seed",)  # overrides that repeat a run rather than change it
# overrides that do not change what runs (summary.* only says how the sweep is summarised;
# trial is the Optuna trial number a study sweeper gives its job)
BOOKKEEPING_KEYS = ("skip_finished", "fail_fast", "summary", "trial")
# settings that change how a run shows itself, not what it computes
DISPLAY_KEYS = ("trainer.enable_progress_bar", "trainer.enable_model_summary")
# settings of how a run uses the machine (its threads, its malloc), not what it computes:
# a sweep's summary and an Optuna study's question leave them out
MACHINE_KEYS = ("cpu_threads", "keep_freed_memory")


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
    return key.split(".", 1)[0] in BOOKKEEPING_KEYS or key in DISPLAY_KEYS


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


def hydra_config() -> DictConfig | None:
    """Hydra's config of this run, or None when ``train`` was called without Hydra."""
    return HydraConfig.get() if HydraConfig.initialized() else None


def in_multirun() -> bool:
    hydra_cfg = hydra_config()
    return hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN


def job_overrides() -> list[str]:
    """This job's overrides (the command line's, or the sweeper's for this job)."""
    hydra_cfg = hydra_config()
    if hydra_cfg is None:
        return []
    # unresolved: an override may hold an interpolation (data.batch_size=${model.d_model})
    return list(OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))


# keys of a sweep's command that its resume command sets itself (Hydra adds hydra.mode)
RESUME_SETS = ("hydra.sweep.dir", "skip_finished", "hydra.mode")


def sweep_resume(
    hydra_cfg: DictConfig | None = None, resumes: str = "this job resumes from it"
) -> list[str] | None:
    """For a job of a multirun, what finishes its sweep (words of a sentence, the command
    second): the sweep's own command (its ``hydra.*`` overrides included, such as the
    search path of the user's configs) with its sweep dir, with ``skip_finished=true`` for
    Hydra's sweeper (the finished jobs are skipped, this one resumes from its
    ``last.ckpt``: ``resumes``); an Optuna study's command as it is (the study gives this
    trial up and asks for its slot again). ``hydra_cfg``: Hydra's config of the sweep (a
    launcher's), else this job's. None outside a multirun."""
    hydra_cfg = hydra_cfg if hydra_cfg is not None else hydra_config()
    if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = Path(str(hydra_cfg.sweep.dir))
    if "study_name" in (hydra_cfg.sweeper or {}):
        return [
            "resume its study with",
            sweep_command(sweep_dir),
            "(this trial is given up, its slot asked again)",
        ]
    command = sweep_command(sweep_dir, ["skip_finished=true"])
    return ["finish its sweep with", command, f"({resumes})"]


def sweep_command(sweep_dir: Path, extra: Sequence[str] = ()) -> str:
    """The command line that runs a multirun again into its own dir, from its saved
    ``multirun.yaml``: its overrides (its ``hydra.*`` ones included, such as the search
    path of the user's configs), its sweep dir, and ``extra`` (which replace the saved
    overrides of the same keys)."""
    path = sweep_dir / "multirun.yaml"
    saved = OmegaConf.load(path) if path.is_file() else OmegaConf.create()
    # as given: an override's ${...} is the job's to resolve (+callbacks.x.seed=${seed})
    given = OmegaConf.to_container(saved, resolve=False).get("hydra", {}).get("overrides", {})
    # the user's hydra.* overrides too: hydra.searchpath finds their kernels' configs
    master = [str(o) for part in ("hydra", "task") for o in given.get(part, ())]
    replaced = {*RESUME_SETS, *(override_key(o) for o in extra)}
    kept = [o for o in master if override_key(o) not in replaced]
    words = ["-m", *kept, f"hydra.sweep.dir={sweep_dir}", *extra]
    return "tlab-train " + " ".join(shlex.quote(w) for w in words)


def sweep_parameters(sweep_dir: Path) -> set[str]:
    """The keys a multirun sweeps: its sweeper's ``params`` and the command line's sweep
    overrides (``attention=softmax,dot``), read from the sweep's ``multirun.yaml``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = set((hydra_config().sweeper.get("params") or {}).keys())
    path = sweep_dir / "multirun.yaml"
    if path.is_file():
        master = [str(o) for o in OmegaConf.load(path).hydra.overrides.task]
        parsed = OverridesParser.create().parse_overrides(master)
        keys |= {o.key_or_group for o in parsed if o.is_sweep_override()}
    return keys
