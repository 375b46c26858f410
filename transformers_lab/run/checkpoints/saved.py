"""A checkpoint read once, safely (``read_checkpoint``): memory-mapped, its pickle allowed
only tensors, plain values and the project's own allow-listed types, an earlier
version's names migrated; one ``SavedCheckpoint`` that resume, test, every evaluation
length and the job's record share. Lightning's own restore reads through ``load_file``
too (``AtomicCheckpointIO``)."""

from __future__ import annotations

import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from transformers_lab.config import moved_targets
from transformers_lab.errors import GIVE_CHECKPOINT, ConfigError, no_checkpoint
from transformers_lab.nn.layers import migrate_block_keys
from transformers_lab.tasks.base import TOKENS_SEEN

log = logging.getLogger(__name__)

# the types besides tensors and plain values that a checkpoint of ours may hold: none
# today (a tokenizer's state, a loader's and a callback's are plain values), and a type
# added here must hold data only: its unpickling may run no code of the file's choosing
SAFE_TYPES: tuple[type, ...] = ()

# the config sections that rebuild a run's model; stored in every checkpoint
MODEL_SECTIONS = ("model", "data", "task")
OUR_MODELS = "transformers_lab.models."
# keys of our classes' saved configs that were renamed: (section, old name) -> new name
RENAMED_KEYS = {("model", "max_len"): "block_size", ("data", "max_len"): "block_size"}
WANDB_ID = "wandb_id"  # a run dir's file: the wandb run its job logs to, resumes included


SHARDED_META = "meta.pt"  # a sharded checkpoint's (a folder's) file of all but the tensors
SHARDED_FROM = "tlab_sharded"  # a read checkpoint's entry: where its weights are, unread


def checkpoint_file(path: str | Path) -> Path:
    """``path`` if a file is there, else a ``ConfigError`` that says what to give."""
    path = Path(path)
    if not path.is_file():
        raise no_checkpoint(path)
    return path


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint: a folder of every process's part of the
    tensors (PyTorch's distributed checkpoint) and ``meta.pt`` (``trainer=fsdp``)."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / SHARDED_META).is_file()


# what the index of a sharded checkpoint (``.metadata``, a pickle) may name besides PyTorch's
# checkpoint classes (``torch.distributed.checkpoint.*``) and its dtypes
METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                    ("collections", "OrderedDict")}  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """The index of a sharded checkpoint unpickled with only the types such an index holds
    (``METADATA_GLOBALS``): PyTorch reads it with plain pickle, which runs whatever a
    crafted file names."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (
            module.startswith("torch.distributed.checkpoint.")
            or dtype
            or ((module, name) in METADATA_GLOBALS)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def sharded_reader(path: Path, trust: bool = False) -> Any:
    """PyTorch's reader of a sharded checkpoint, its index read by ``MetadataUnpickler``
    unless the run trusts the folder; a crafted index is refused as ``load_file`` refuses
    a crafted file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        read: Any = None  # the index, once read: PyTorch's load asks for it again

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.read is None:
                self.read = self.unpickled(*args, **kwargs)
            return self.read

        def unpickled(self, *args: Any, **kwargs: Any) -> Any:
            if trust:
                return super().read_metadata(*args, **kwargs)
            with open(path / ".metadata", "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:  # as PyTorch's own reader
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = CheckedReader(str(path))
    try:
        reader.metadata = reader.read_metadata()
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        raise ConfigError(
            f"{path}/.metadata asks to run {named[1] if named else 'code'} as it loads: "
            "refused, as such a file can run any code; if you trust whoever made it, load it "
            "with trust_checkpoint=true"
        ) from None
    return reader


def sharded_shapes(path: Path, trust: bool = False, reader: Any = None) -> dict[str, torch.Tensor]:
    """The model's tensors of a sharded checkpoint as its index gives them (read by
    ``reader`` where one is given), on the meta device: their names, shapes and dtypes,
    nothing read (``sharded_weights`` reads them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = reader or sharded_reader(path, trust)
    prefix = "state_dict."
    return {
        key.removeprefix(prefix): torch.empty(meta.size, dtype=meta.properties.dtype, device="meta")
        for key, meta in reader.metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def sharded_weights(path: Path, trust: bool = False) -> dict[str, torch.Tensor]:
    """The model's weights of a sharded checkpoint, whole, read in this one process from
    every process's part (the optimizer's state is left on disk)."""
    from torch.distributed.checkpoint import load

    reader = sharded_reader(path, trust)  # the index read once, for the shapes and the load
    shapes = sharded_shapes(path, trust, reader)
    state = {"state_dict": {k: torch.empty_like(v, device="cpu") for k, v in shapes.items()}}
    with warnings.catch_warnings():  # that it reads in one process: what it is asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state, storage_reader=reader, no_dist=True)
    return state["state_dict"]


def load_file(path: str | Path, trust: bool = False, mmap: bool = True) -> Any:
    """What a checkpoint file holds, its tensors memory-mapped (``mmap``): with ``trust``
    false (the default), only tensors, plain values and ``SAFE_TYPES`` are unpickled, and
    a file that needs anything else is refused in one line that names the type, before
    any of it is built. The one place a checkpoint file is opened."""
    path = checkpoint_file(path)
    try:
        with torch.serialization.safe_globals(list(SAFE_TYPES)):
            try:
                return torch.load(path, map_location="cpu", weights_only=not trust, mmap=mmap)
            except RuntimeError as exc:  # a file of torch's old format cannot be mapped
                if not (mmap and "mmap can only be used" in str(exc)):
                    raise
                return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if trust or named is None:
            not_one = f"{path} is not a checkpoint ({first_line(exc)}); {GIVE_CHECKPOINT}"
            raise ConfigError(not_one) from exc
        raise ConfigError(
            f"{path} asks to run {named[1]} as it loads (it holds more than tensors and plain "
            f"values): refused, as such a file can run any code; if you trust whoever made "
            f"it, load it with trust_checkpoint=true"
        ) from None
    except Exception as exc:  # torch.load fails in many ways on a file that is no checkpoint
        not_one = f"{path} is not a checkpoint ({first_line(exc)}); {GIVE_CHECKPOINT}"
        raise ConfigError(not_one) from exc


def first_line(exc: BaseException) -> str:
    """Why torch could not read a file, in one line: the weights-only unpickler's own
    reason where it gives one (its first lines are advice for code), else the first."""
    said = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    reason = re.search(r"WeightsUnpickler error:\s*([^\n]+)", said)
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    return reason[1].strip() if reason else lines[0] if lines else type(exc).__name__


class SavedCheckpoint:
    """A checkpoint of ``tlab-train``, read once (``read_checkpoint``): its contents
    (``contents``, tensors mapped from the file), the step and fitting time it was saved
    at, the run dir that wrote it and that run's wandb id, and the model, data and task
    config it was trained with (``config``, an earlier version's names migrated)."""

    def __init__(self, path: str | Path, contents: dict[str, Any]) -> None:
        self.path, self.contents = Path(path), contents

    @property
    def step(self) -> int | None:
        step = self.contents.get("global_step")
        return None if step is None else int(step)

    @property
    def tokens(self) -> int | None:
        """The training tokens seen up to this checkpoint, all processes together (None:
        a checkpoint of an earlier version, which did not count them)."""
        tokens = self.contents.get(TOKENS_SEEN)
        return int(tokens) if isinstance(tokens, int | float) else None

    @property
    def epoch(self) -> int | None:
        return self.contents.get("epoch")

    @property
    def time_s(self) -> float:
        """The fitting time its run had spent when it was saved, its earlier parts
        included (what the ``Checkpoint`` callback keeps); 0 where it holds none."""
        states = self.contents.get("callbacks", {}).values()
        found = (float(s["time_s"]) for s in states if isinstance(s, dict) and "time_s" in s)
        return next(found, 0.0)

    @property
    def config(self) -> dict[str, Any]:
        """The resolved model, data and task config it was trained with (``tlab_config``);
        empty for a checkpoint that tlab-train did not write."""
        return self.contents.get("tlab_config") or {}

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights; a sharded checkpoint's are read whole the first time they
        are asked for (a resume reads none: each process reads its part)."""
        sharded = self.contents.get(SHARDED_FROM)
        if sharded is not None:
            weights = sharded_weights(Path(sharded["path"]), sharded["trust"])
            self.contents["state_dict"] = weights
            del self.contents[SHARDED_FROM]
        return self.contents.get("state_dict", {})

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Each tensor's shape, by name, without reading a sharded checkpoint's weights."""
        return {k: v.shape for k, v in self.contents.get("state_dict", {}).items()}

    @property
    def run_dir(self) -> Path:
        """The run dir that wrote it: the folder above its ``checkpoints/``."""
        folder = self.path.resolve().parent
        return folder.parent if folder.name == "checkpoints" else folder

    @property
    def wandb_id(self) -> str | None:
        """The wandb run its run logged to (the run dir's ``wandb_id``), if known."""
        marker = self.run_dir / WANDB_ID
        return marker.read_text().strip() or None if marker.is_file() else None

    def state_of(self, module: Any) -> Any:
        """The state it holds for ``module`` (a data module's tokenizer), by class name."""
        return self.contents.get(type(module).__qualname__)

    def run_config(self, data: Any = None, model: Any = None) -> DictConfig:
        """Its model, data and task config, the command line's ``data.*`` merged (and
        ``model.*``: the context of an evaluation at another length)."""
        if not self.config:
            raise ConfigError(
                f"checkpoint {self.path} holds no tlab_config: it was not written by "
                "tlab-train, so its model cannot be rebuilt; train with tlab-train, or load "
                "it in Python"
            )
        run = OmegaConf.create(self.config)
        run.data = OmegaConf.merge(run.data, data or {})
        if model:
            run.model = OmegaConf.merge(run.model, model)
        return run


def read_checkpoint(path: str | Path, trust: bool = False) -> SavedCheckpoint:
    """A checkpoint read once (``load_file``), with a clear error when the file is not
    there or is not a checkpoint; an earlier version's names are migrated in place. A
    sharded checkpoint (a folder, ``trainer=fsdp``) is read whole in this process."""
    sharded = is_sharded(path)
    contents = load_file(Path(path) / SHARDED_META if sharded else path, trust)
    if sharded and isinstance(contents, dict):
        try:  # the tensors' shapes: the weights are read when asked (``state_dict``)
            contents["state_dict"] = sharded_shapes(Path(path), trust)
        except ConfigError:
            raise
        except Exception as exc:  # a torn or foreign folder
            raise ConfigError(f"{path}: its shards cannot be read ({first_line(exc)})") from exc
        contents[SHARDED_FROM] = {"path": str(path), "trust": trust}
    if not isinstance(contents, dict):
        raise ConfigError(
            f"{path} is not a checkpoint (it holds a {type(contents).__name__}); {GIVE_CHECKPOINT}"
        )
    config = contents.get("tlab_config") or {}
    ours = str((config.get("model") or {}).get("_target_", "")).startswith(OUR_MODELS)
    if ours and migrate_block_keys(contents.get("state_dict", {})):
        log.info("%s: an earlier version's checkpoint; Block.attn is Block.mixer now", path)
    for key in migrate_config(config):
        log.info("%s: an earlier version's checkpoint; %s is %s now", path, *key)
    return SavedCheckpoint(path, contents)


def migrate_config(config: dict[str, Any]) -> list[tuple[str, str]]:
    """Rename, in place, what an earlier version's saved config (``tlab_config``) names
    otherwise: the keys of our classes (``RENAMED_KEYS``: the context is ``block_size``
    everywhere) and the ``_target_`` of a class that moved (``config.MOVED``);
    returns each (old, new) pair renamed."""
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


def checkpoint_step(path: str | Path) -> int | None:
    """The training step a checkpoint was saved at, or None if it cannot be read (the
    summary's curves fall back)."""
    try:
        return read_checkpoint(path).step
    except ConfigError:
        return None


def resolved_sections(config: DictConfig, keys: tuple[str, ...] = MODEL_SECTIONS) -> dict:
    """Plain, resolved copies of the config sections that rebuild a run's model: what
    every checkpoint keeps (``tlab_config``), and what a resumed run is held to."""
    return {k: OmegaConf.to_container(config[k], resolve=True) for k in keys if k in config}
