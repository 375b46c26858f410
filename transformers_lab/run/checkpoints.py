"""Checkpoints of tlab-train: reading one with a clear error, the step it was saved at,
and refusing one that does not fit the run (its weights, or the config it was trained
with)."""

from __future__ import annotations

import difflib
import inspect
import logging
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from transformers_lab.config import flatten
from transformers_lab.errors import ConfigError
from transformers_lab.files import atomic_write
from transformers_lab.nn.layers import migrate_block_keys
from transformers_lab.run.build import (
    build_datamodule,
    build_model,
    build_task,
    moved_targets,
    target_class,
)
from transformers_lab.run.overrides import override_key

log = logging.getLogger(__name__)

# the sections of a run's config that rebuild its model; stored in every checkpoint
MODEL_SECTIONS = ("model", "data", "task")


def resolved_sections(config: DictConfig, keys: tuple[str, ...] = MODEL_SECTIONS) -> dict:
    """Plain, resolved copies of the config sections that rebuild a run's model: what
    every checkpoint keeps (``tlab_config``), and what a resumed run is held to."""
    return {k: OmegaConf.to_container(config[k], resolve=True) for k in keys if k in config}


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
    config = checkpoint.get("tlab_config") or {}
    ours = str((config.get("model") or {}).get("_target_", "")).startswith(OUR_MODELS)
    if ours and migrate_block_keys(checkpoint.get("state_dict", {})):
        log.info("%s: an earlier version's checkpoint; Block.attn is Block.mixer now", path)
    for key in migrate_config(config):
        log.info("%s: an earlier version's checkpoint; %s is %s now", path, *key)
    return checkpoint


OUR_MODELS = "transformers_lab.models."
# keys of our classes' saved configs that were renamed: (section, old name) -> new name
RENAMED_KEYS = {("model", "max_len"): "block_size", ("data", "max_len"): "block_size"}


def migrate_config(config: dict[str, Any]) -> list[tuple[str, str]]:
    """Rename, in place, what an earlier version's saved config (``tlab_config``) names
    otherwise: the keys of our classes (``RENAMED_KEYS``: the context is ``block_size``
    everywhere) and the ``_target_`` of a class that moved (``run.build.MOVED``); returns
    each (old, new) pair renamed."""
    renamed = moved_targets(config)
    for (section, old), new in RENAMED_KEYS.items():
        node = config.get(section)
        ours = isinstance(node, dict) and str(node.get("_target_", "")).startswith(
            "transformers_lab."
        )
        if ours and old in node and new not in node:
            node[new] = node.pop(old)
            renamed.append((f"{section}.{old}", f"{section}.{new}"))
    return renamed


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
    parts included (what ``Checkpoint`` keeps); 0 where it holds none or cannot
    be read: nothing earlier to count."""
    states = (peek(path) or {}).get("callbacks", {}).values()
    return next((float(s["time_s"]) for s in states if isinstance(s, dict) and "time_s" in s), 0.0)


ABSENT = "(absent)"


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
    try:
        param = inspect.signature(target_class(OmegaConf.create({"_target_": target})))
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
        if {shown(before), shown(after)} == {ABSENT, "None"}:
            continue
        if ABSENT in (before, after):  # the side that has it gives the class's default
            side = new if before is ABSENT else old
            default = constructor_default(side, key)
            if default is not ABSENT and side[key] == default:
                continue
        if before != after:
            out.append(f"{key}: {shown(before)} -> {shown(after)}")
    return out


def shown(value: Any) -> str:
    return value if value is ABSENT else repr(value)


def check_checkpoint(
    checkpoint: dict[str, Any], module: torch.nn.Module, path: Any, changed: Sequence[str] = ()
) -> None:
    """Refuse, in one line, a checkpoint whose weights do not fit ``module``, naming the
    options ``changed`` from the checkpoint's own (``key: old -> new``, as ``check_resume``
    returns them), else the tensors that differ."""
    own = module.state_dict()
    saved = checkpoint.get("state_dict", {})
    mismatched = [
        key
        for key in sorted(set(own) | set(saved))
        if key not in own or key not in saved or own[key].shape != saved[key].shape
    ]
    if not mismatched:
        return
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
    "data.cache_dir",
    "data.prepared_dir",  # a corpus's shards: where they are, and how many make them
    "data.prepare_workers",
    "task.sample_every",
    "task.sample_tokens",
    "model.attention.backend",  # the gated kernels' fla or our chunk loop: one recurrence
)


def check_resume(
    checkpoint: dict[str, Any], config: dict, path: Any, may_change: Sequence[str] = ()
) -> list[str]:
    """Refuse to resume ``checkpoint`` into a run whose model, data or task config (the
    kernel's class and options included) differs from the one it was trained with; the
    one-line error names each key with its old and new value. Returns the changes that
    ``may_change`` allowed (``key: old -> new``), for ``check_checkpoint`` to name."""
    saved = checkpoint.get("tlab_config") or {}
    old, new = flatten({k: saved.get(k, {}) for k in config}), flatten(config)
    check_may_change(may_change, config, old, new)
    if not saved:  # not written by tlab-train: only the tensor shapes can be checked
        return []
    changed = flat_differences(old, new, (*RESUME_MAY_CHANGE, *may_change))
    if not changed:
        return flat_differences(old, new, RESUME_MAY_CHANGE)
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


class Checkpoint(ModelCheckpoint):
    """``ModelCheckpoint`` as a researcher expects it.

    - ``last.ckpt`` is rewritten at every save point. Lightning 2.6 rewrites it only when
      a top-k checkpoint is saved at the same step, so after a validation that was not a
      new best it kept an older state and a resume went back in time.
    - On SIGTERM (and on Ctrl+C, with ``StopOnSignal``) ``last.ckpt`` is saved before the
      run stops. Other exceptions save nothing: the last good checkpoint stays as it was.
    - Resumed into a new run dir, the best checkpoints so far are copied there with their
      scores, so the best is still the best of the whole run (Lightning would forget it).
    - A monitored metric the run does not log is a one-line ``ConfigError`` that lists the
      ones it does: after the sanity check for a ``val/`` metric, before any training, and
      otherwise at the first save (Lightning raises there, with a hint for code authors).
    - Each checkpoint holds the run's fitting time so far, its earlier parts included
      (``time_s``; ``checkpoint_time``), so that a resumed job's wall time counts them.
    """

    TIME = "time_s"
    started: float | None = None  # when this part's fit set up (None: not yet)
    earlier = 0.0  # the fitting time of the parts before it (its checkpoint's)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.started, self.earlier = time.perf_counter(), 0.0

    def state_dict(self) -> dict[str, Any]:
        elapsed = 0.0 if self.started is None else time.perf_counter() - self.started
        return {**super().state_dict(), self.TIME: self.earlier + elapsed}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking and str(self.monitor).startswith("val/"):
            self.check_monitor(self._monitor_candidates(trainer))
        super().on_validation_end(trainer, pl_module)

    def check_monitor(self, metrics: dict[str, Any]) -> None:
        if self.monitor is None or self.monitor in metrics:
            return
        logged = ", ".join(sorted(k for k in metrics if k not in ("epoch", "step"))) or "none"
        raise ConfigError(
            f"monitor.metric={self.monitor} is not a metric this run logs (it logs: {logged}); "
            "set monitor.metric= to one of them"
        )

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        if self.save_top_k:
            self.check_monitor(monitor_candidates)
        super()._save_topk_checkpoint(trainer, monitor_candidates)
        # Lightning's hooks save last.ckpt when a checkpoint was written at this step
        self._last_global_step_saved = trainer.global_step

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not (isinstance(exception, SIGTERMException) and self.save_last):
            return
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if self._last_global_step_saved != trainer.global_step or not self.last_model_path:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.earlier = float(state_dict.get(self.TIME, 0.0))
        old = state_dict.get("dirpath")
        if self.dirpath and old and old != self.dirpath:
            state_dict = self.moved_state(state_dict)
        super().load_state_dict(state_dict)

    def moved_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with its best checkpoints copied into this callback's dirpath."""
        moved = {p: str(Path(self.dirpath) / Path(p).name) for p in state["best_k_models"]}
        moved = {old: new for old, new in moved.items() if Path(old).is_file()}
        if rank_zero_only.rank == 0 and moved:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            for old, new in moved.items():
                shutil.copy2(old, new)
        return {
            **state,
            "dirpath": self.dirpath,
            "best_k_models": {moved[p]: s for p, s in state["best_k_models"].items() if p in moved},
            "best_model_path": moved.get(state["best_model_path"], ""),
            "kth_best_model_path": moved.get(state["kth_best_model_path"], ""),
            "last_model_path": "",
        }


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write each checkpoint to a temporary file in its own folder, flush it to disk and
    rename it over the target: a rename within a folder is atomic, so a kill at any moment
    leaves either the old checkpoint or the new one, never a torn file. (Lightning's own
    writer stages the file in the system's temp dir; moved to another file system, that
    is a copy over the target, which a kill can leave half-written.)"""

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        atomic_write(path, lambda f: torch.save(checkpoint, f), sync=True)


def saved_run(
    checkpoint: dict[str, Any], path: Any, data_overrides: Any, model_overrides: Any = None
) -> DictConfig:
    """The run config stored in a checkpoint, with the command line's ``data.*`` merged
    (and ``model.*``: the context of an evaluation at another length)."""
    saved = checkpoint.get("tlab_config")
    if not saved:
        raise ConfigError(
            f"checkpoint {path} holds no tlab_config: it was not written by tlab-train, so "
            f"its model cannot be rebuilt; train with tlab-train, or load it in Python"
        )
    run = OmegaConf.create(saved)
    run.data = OmegaConf.merge(run.data, data_overrides or {})
    if model_overrides:
        run.model = OmegaConf.merge(run.model, model_overrides)
    return run


class WrongModel(ConfigError):
    """A checkpoint of another model class than the one asked for (``restore``'s
    ``needs``); ``found`` is its class, for a tool to say which other tool takes it."""

    def __init__(self, message: str, found: type) -> None:
        super().__init__(message)
        self.found = found


class Restored(NamedTuple):
    """A checkpoint brought back: its contents, its data module (the tokenizer it was
    trained with) and its task, weights loaded (``task.model`` is the network)."""

    checkpoint: dict[str, Any]
    datamodule: L.LightningDataModule
    task: Any


def restore(
    ckpt_path: str | Path,
    data: Any = None,
    needs: type | None = None,
    wanted: str = "",
    model: Any = None,
) -> Restored:
    """The one way back from a checkpoint, for ``tlab-eval``, ``tlab-sample``,
    ``tlab-translate`` and notebooks: the saved run's data module (``data`` overrides
    entries of its config), model and task built, the weights checked and loaded. With
    ``needs``, a checkpoint of another model class is refused before anything is built,
    in one line that starts with what is ``wanted``. ``model`` overrides entries of the
    model config that hold no weights (``block_size``, for another length)."""
    checkpoint = load_checkpoint(ckpt_path)
    run = saved_run(checkpoint, ckpt_path, data, model)
    if needs is not None:
        cls = target_class(run.model)
        if not (isinstance(cls, type) and issubclass(cls, needs)):
            trained_on = str(run.data.get("_target_", "?")).rpartition(".")[2]
            raise WrongModel(
                f"{wanted or f'a {needs.__name__} checkpoint is needed'}; {ckpt_path} holds a "
                f"{cls.__name__} trained on {trained_on}",
                cls,
            )
    datamodule = build_datamodule(run.data, checkpoint)  # the tokenizer it was trained with
    task = build_task(run.task, build_model(run.model, datamodule), datamodule)
    changed = differences(checkpoint.get("tlab_config") or {}, resolved_sections(run))
    check_checkpoint(checkpoint, task, ckpt_path, changed)
    task.load_state_dict(checkpoint["state_dict"])
    return Restored(checkpoint, datamodule, task.eval())


def check_split(datamodule: L.LightningDataModule, split: str) -> None:
    """Refuse ``split=test`` on a restored run's data that has no test split."""
    if split == "test" and not is_overridden("test_dataloader", datamodule):
        raise ConfigError(f"{type(datamodule).__name__} has no test split; use split=val")


def load_task(
    ckpt_path: str | Any, data: dict[str, Any] | None = None
) -> tuple[Any, L.LightningDataModule]:
    """A checkpoint's task in eval mode, weights loaded (``task.model`` is the network),
    and its data module set up with the tokenizer it was trained with; for notebooks and
    scripts. ``data`` overrides entries of the saved data config (e.g. ``batch_size``)."""
    restored = restore(ckpt_path, data)
    return restored.task, restored.datamodule
