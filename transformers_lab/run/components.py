"""The run's components from its config, in the order the data flows: the data module
first (it tells the model what it needs: ``model_kwargs()``, vocabulary, context, image
geometry), the model with its kernel factory, the task around it (``build_components``);
or the model and task on the meta device, sized with stand-ins, for the preflight, and
the run at each length it will be scored at (``build_on_meta``, ``plan``); or a saved
run's, its weights loaded from the checkpoint already read (``restore``). Each refusal of
a combination is one ``ConfigError`` that names the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig, OmegaConf

from transformers_lab.config import (
    data_compatible_models,
    expand_hybrid,
    instantiation_refusals,
    option_classes,
    srun_task,
)
from transformers_lab.data.base import TextData
from transformers_lab.errors import ConfigError
from transformers_lab.run.checkpoints.compare import Resume
from transformers_lab.run.checkpoints.saved import SavedCheckpoint
from transformers_lab.run.memory import keep_freed_memory
from transformers_lab.run.record import say


def call(config: DictConfig, what: str, **kwargs: Any) -> Any:
    """``instantiate`` the node at ``what``, refused in its target's own words
    (``config.instantiation_refusals``)."""
    with instantiation_refusals(what):
        return instantiate(config, **kwargs)


def target_class(config: DictConfig) -> type:
    """The class (or function) a config's ``_target_`` names."""
    module, _, name = str(config._target_).rpartition(".")
    return getattr(importlib.import_module(module), name)


def option(name: str) -> str:
    """The group option chosen for ``name`` in the running Hydra app, else ``name``."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return f"{name}={HydraConfig.get().runtime.choices.get(name, '?')}"
    return name


# what a data module raises for a value of its config that it cannot use
REFUSALS = (ValueError, LookupError, TypeError)


def build_datamodule(
    config: DictConfig, checkpoint: Any = None, setup: bool = True, where: str = ""
) -> L.LightningDataModule:
    """The data module of ``config``, ready to size a model: built, given the state that
    ``checkpoint`` (a ``SavedCheckpoint``) holds for it (the tokenizer a model was trained
    with), its files fetched (``prepare_data``) and its splits set up, on the first local
    process (under DDP the trainer sets up the others once that one has the files); with
    ``setup=False`` only constructed (nothing fetched or read: the preflight's). A value
    that the module refuses on the way, in its constructor or deep in a tokenizer's
    loader, is one ``ConfigError`` that names the data config and the key
    (``data_refusal``), after ``where`` (``at length 256: ``)."""
    factory = call(config, "data", _partial_=True)  # a _target_ that cannot be imported
    try:
        datamodule = factory()
        if not setup:
            return datamodule
        state = checkpoint.state_of(datamodule) if checkpoint is not None else None
        if state:
            datamodule.load_state_dict(state)
        if local_rank() == 0:
            datamodule.prepare_data()
            datamodule.setup("fit")  # every split: the modules here set up all at once
    except ConfigError:
        raise
    except REFUSALS as exc:
        raise ConfigError(where + data_refusal(config, exc)) from exc
    return datamodule


def local_rank() -> int:
    """This process's rank on its machine: torchrun's and Lightning's ``LOCAL_RANK``, or
    SLURM's ``SLURM_LOCALID`` in a task of a several-task ``srun``."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return int(os.environ.get("SLURM_LOCALID", 0)) if srun_task() is not None else 0


def check_split(data: DictConfig | L.LightningDataModule, split: str) -> None:
    """Refuse ``split=test`` on data (its config, or the module) that has no test split."""
    module = target_class(data) if isinstance(data, DictConfig) else data
    if split == "test" and not is_overridden("test_dataloader", module, L.LightningDataModule):
        name = module.__name__ if isinstance(module, type) else type(module).__name__
        raise ConfigError(f"{name} has no test split; use split=val")


def data_refusal(config: DictConfig, exc: Exception) -> str:
    """A data module's refusal in one line: the data config, the keys it is about (those
    its message names, or whose value it quotes, as an encoding's name), and the message.
    A data config is its module's keyword arguments, one level deep."""
    given = OmegaConf.to_container(config, resolve=True)
    values = {key: value for key, value in given.items() if not str(key).startswith("_")}
    said = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    keys = [
        f"data.{key}={value!r}"
        for key, value in values.items()
        if re.search(rf"(?<![\w/-]){re.escape(key)}(?![\w/.-])", said)  # a word, not in a path
        or (isinstance(value, str) and repr(value) in said)
    ]
    # tlab-eval's data config is the checkpoint's, which no option of its own chose
    what = f"{option('data').removesuffix('=?')} ({target_class(config).__name__})"
    return f"{what} refuses {', '.join(keys) or 'a value of its config'}: {said}"


# data keys where the model may hold more than the data needs (spare positions or ids)
AT_LEAST = {"block_size", "vocab_size", "src_vocab_size", "tgt_vocab_size"}


def model_kwargs(config: DictConfig, datamodule: Any) -> dict[str, Any]:
    """The data module's ``model_kwargs()`` merged into the model config.

    A key the model config leaves null comes from the data. A key set in both must agree:
    positions and vocabulary may be larger in the model (``block_size``, vocab
    sizes), everything else (image size, classes, special ids) must be equal. A key
    the model class does not take means the model and the data do not fit together.
    """
    provided = dict(datamodule.model_kwargs()) if hasattr(datamodule, "model_kwargs") else {}
    check_fit(config, provided)
    merged = {}
    for key, value in provided.items():
        mine = config.get(key)
        if mine is None:
            merged[key] = value
        elif key in AT_LEAST and mine < value:
            raise ConfigError(
                f"model.{key}={mine} is smaller than the data's {key}={value}: the model "
                f"would meet {'positions' if key == 'block_size' else 'ids'} it "
                f"has no embedding for; set model.{key}={value} (or null to take the data's) "
                f"or make the data smaller"
            )
        elif key not in AT_LEAST and mine != value:
            raise ConfigError(
                f"model.{key}={mine} does not match the data's {key}={value}; set "
                f"model.{key}=null to take it from the data"
            )
    return merged


def check_fit(config: DictConfig, provided: Iterable[str]) -> None:
    """Refuse a model that has no option for a size the data gives (``model=gpt`` on
    ListOps' classes): the model and the data do not fit together."""
    cls = target_class(config)
    provided = sorted(provided)
    unknown = sorted(set(provided) - set(inspect.signature(cls).parameters))
    if unknown:
        fits = data_compatible_models(set(provided))
        hint = f"use model={' or model='.join(fits)}" if fits else "pick another model"
        raise ConfigError(
            f"{option('model')} ({cls.__name__}) cannot take {option('data')}: the data "
            f"provides {', '.join(provided)} but {cls.__name__} has no "
            f"{', '.join(unknown)}; {hint}, or choose data that {cls.__name__} takes"
        )


# a model's refusal that names its config key already (a layer's: ``nn.Block``)
KEYED = ("attention:", "cross_attention:", "model.")


def model_refusal(exc: Exception, config: DictConfig) -> ConfigError:
    """A model constructor's refusal as one line that names the key: its own words where
    they name one (``attention: ...``, ``model.hybrid, layer 1 (...)``), ``model.<key>``
    where they start with one of its options (``n_head must be ...``), else ``model:``."""
    said = str(exc)
    if said.startswith(KEYED):
        return ConfigError(said)
    first = said.split(" ", 1)[0]
    if first in inspect.signature(target_class(config)).parameters:
        return ConfigError(f"model.{said}")
    return ConfigError(f"model: {said}")


def model_factory(config: DictConfig) -> Any:
    """The model class of ``config`` with its options, the layers ``model.hybrid`` names
    as their configs, waiting for the sizes the data gives (``model_kwargs``)."""
    return call(expand_hybrid(config), "model", _partial_=True)


def build_model(config: DictConfig, datamodule: Any) -> torch.nn.Module:
    """The model of ``config`` sized for ``datamodule``."""
    sizes = model_kwargs(config, datamodule)
    factory = model_factory(config)
    try:
        return factory(**sizes)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise model_refusal(exc, config) from exc


def on_meta(build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``build(*args, **kwargs)`` on the meta device (no memory, no initialisation), or on
    the CPU for a kernel of the user's that reads its tensors' values while it is built
    (``.item()``, ``.numpy()``), which the meta device cannot give. A refusal
    (ValueError; a TypeError again on the CPU) goes up as the constructor raised it."""
    try:
        with torch.device("meta"):
            return build(*args, **kwargs)
    except ValueError:
        raise
    except (RuntimeError, NotImplementedError, TypeError):
        return build(*args, **kwargs)


# what the data would size, as small stand-ins: the model is built before the data is read
PLACEHOLDERS = {
    "vocab_size": 8,
    "src_vocab_size": 8,
    "tgt_vocab_size": 8,
    "num_classes": 2,
    "in_channels": 1,
    "pad_id": 0,
    "bos_id": 1,
    "eos_id": 2,
}


def placeholder_sizes(model: DictConfig, data: Any) -> dict[str, Any]:
    """Stand-ins for the sizes ``model`` leaves to the data (null): small vocabularies and
    classes, the data config's context (the one the model will get), an image of a few
    patches."""
    context = data.get("block_size") or 16
    sizes: dict[str, Any] = {}
    for key, value in model.items():
        if value is not None:
            continue
        if key in PLACEHOLDERS:
            sizes[str(key)] = PLACEHOLDERS[str(key)]
        elif key == "block_size":
            sizes[str(key)] = context
        elif key == "image_size" and model.get("patch_size") is not None:  # 4 x 4 patches
            patch = model.get("patch_size")
            stride = model.get("patch_stride") or patch
            sizes[str(key)] = max(patch + 3 * stride - 2 * (model.get("patch_padding") or 0), 1)
    return sizes


def build_on_meta(
    cfg: DictConfig, lengths: Sequence[int] = (), depths: Sequence[float] | None = None
) -> torch.nn.Module | None:
    """The run built as it will be, for the preflight, before any data is read: the data
    module constructed (nothing fetched or read), the model on the meta device sized with
    stand-ins for what the data gives (``placeholder_sizes``), and the task around it;
    and the run at each of the ``lengths`` (and needle ``depths``) it will be scored at
    (``plan``). Their constructors' own refusals (a data size, the kernel's options, the
    layer's parts, RoPE, ALiBi, causal or both ways, positions, a hybrid's layers, the
    task's settings) are met at once, in their own words. Returns the model on the meta
    device (None where the config has none, or a model of the user's needs a size only
    its data gives)."""
    data, model, task = (cfg.get(key) for key in ("data", "model", "task"))
    datamodule = None
    if isinstance(data, DictConfig) and "_target_" in data:  # its constructor: nothing read
        datamodule = build_datamodule(data, setup=False)
    if not isinstance(model, DictConfig) or "_target_" not in model:
        return None
    if hasattr(datamodule, "model_keys"):  # the sizes it will give, before drawing them
        check_fit(model, datamodule.model_keys())
    factory = model_factory(model)
    sizes = placeholder_sizes(model, data or {})
    params = inspect.signature(target_class(model)).parameters
    given = {str(k) for k, v in model.items() if v is not None} | set(sizes)
    if "vocab_size" in params and not {"vocab_size", "image_size"} & given:
        sizes["vocab_size"] = PLACEHOLDERS["vocab_size"]  # token input (no patches)
        given.add("vocab_size")
    if any(p.default is p.empty and name not in given for name, p in params.items()):
        return None  # a model of the user's that needs a size only its data gives
    try:
        built = on_meta(factory, **sizes)
    except (ValueError, TypeError) as exc:
        raise model_refusal(exc, model) from None
    if isinstance(task, DictConfig) and "_target_" in task:
        with torch.device("meta"):
            build_task(task, built)
    if lengths and isinstance(data, DictConfig):
        plan(built, OmegaConf.to_container(data, resolve=True), lengths, depths)
    return built


def plan(
    model: Any,
    data: dict[str, Any],
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    what: str = "the model",
) -> dict[tuple[int, float | None], dict[str, Any]]:
    """The data config's entries at each (length, depth) to score ``model`` (trained on
    ``data``) at, every one checked first: the model reaches the length (``reach``), the
    data is built there, and depths are asked of needle data only. ``what`` names the
    model in a refusal (the checkpoint)."""
    if not callable(getattr(model, "reach", None)):
        kind = "model sized by its data" if model is None else type(model).__name__
        raise ConfigError(
            f"evaluation at other lengths scores a GPT (language model, MQAR, needles); "
            f"{what} is a {kind}"
        )
    if "block_size" not in data:
        raise ConfigError(
            f"evaluation at other lengths needs data of sequences with a block_size; "
            f"{data.get('_target_', '?')} has none"
        )
    if depths is not None and "depth" not in data:
        raise ConfigError(
            "eval_depths sweeps a needle's depth, but the data has none (it is no needle "
            "task: data=passkey, needle_text or needle_multikey); drop eval_depths"
        )
    settings = {}
    for n, d in [(n, d) for n in lengths for d in (depths or [None])]:
        reason = model.reach(n)
        if reason:
            raise ConfigError(f"cannot evaluate {what} at length {n}: {reason}")
        settings[n, d] = at_length(data, data["block_size"], n)
        if d is not None:
            settings[n, d]["depth"] = d
        config = OmegaConf.create({**data, **settings[n, d]})
        build_datamodule(config, setup=False, where=f"at length {n}: ")
    return settings


def at_length(data: dict[str, Any], trained: int, length: int) -> dict[str, Any]:
    """The data config's entries at ``length``: its context, and MQAR's key-value pairs
    scaled with it (as many per token as at the ``trained`` length)."""
    out: dict[str, Any] = {"block_size": length}
    if data.get("problem") == "mqar" and data.get("num_kv_pairs"):
        out["num_kv_pairs"] = max(1, data["num_kv_pairs"] * length // trained)
    return out


def compile_model(model: torch.nn.Module) -> str:
    """``torch.compile`` the model in place (its state dict keeps its keys); a part that
    fails to compile later runs eagerly (dynamo's ``suppress_errors``). Returns the line
    that says what runs: the model compiled, or why the compiler cannot run here (the
    model is left as it was)."""
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(2))
    except Exception as exc:  # no C++ compiler, an unsupported platform or Python
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return f"compile=true: torch.compile is unavailable here ({why}); training in eager mode"
    torch._dynamo.config.suppress_errors = True
    model.compile()
    return (
        f"compile=true: the model ({type(model).__name__}) runs through torch.compile "
        "(inductor), which compiles it at its first batch"
    )


def build_task(
    config: DictConfig,
    model: torch.nn.Module,
    datamodule: Any = None,
    run_config: dict[str, Any] | None = None,
) -> Any:
    """The LightningModule of ``config`` around ``model``; a data module that can
    ``detokenize`` (ids -> text) lets the task log samples; ``run_config`` (the resolved
    model, data and task sections) is saved in its checkpoints."""
    detokenize = datamodule.detokenize if isinstance(datamodule, TextData) else None
    check_task_trains(target_class(config), model)
    # Python objects go to the constructor itself: Hydra would build run_config's nodes
    factory = call(config, "task", _partial_=True)
    try:
        return factory(model=model, detokenize=detokenize, run_config=run_config)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"task: {exc}") from exc


# the project's model classes: a task refuses one it does not train (a model of the
# user's own classes is left to the task to judge)
MODEL_CLASSES = frozenset({"GPT", "EncoderClassifier", "ViT", "Transformer"})


def check_task_trains(task_class: type, model: torch.nn.Module) -> None:
    """Refuse a task for a model it cannot train (``Task.trains``), naming the task options
    that train it: a language-model task on a ViT would fail at its first loss."""
    trains = getattr(task_class, "trains", ())
    names = [c.__name__ for c in type(model).__mro__]
    if not trains or not MODEL_CLASSES & set(names) or set(trains) & set(names):
        return
    fits = [
        name for name, cls in option_classes("task") if set(getattr(cls, "trains", ())) & set(names)
    ]
    hint = f"use task={' or task='.join(fits)}, or " if fits else ""
    raise ConfigError(
        f"{option('task')} ({task_class.__name__}) trains {' or '.join(trains)} models, not "
        f"{option('model')} ({type(model).__name__}): {hint}leave task= out (each model has "
        f"its own, conf/task/<model>.yaml)"
    )


class Components(NamedTuple):
    """A run's data module, model and task (``task.model`` is ``model``), the line that
    says whether the model runs compiled (None: not asked), and what its seed fixed
    (``seeded``; None where not asked)."""

    datamodule: L.LightningDataModule
    model: torch.nn.Module
    task: Any
    compiled: str | None = None
    seeded: dict[str, Any] | None = None


def build_components(cfg: DictConfig, resume: Any = None, fingerprint: bool = False) -> Components:
    """The data module, model and task of ``cfg`` (its ``data``, ``model`` and ``task``),
    in that order, on the CPU threads and from the seed it gives (``use_cpu``; a saved
    run's config has neither): the data with the state the ``resume``'s checkpoint holds
    for it (a ``checkpoints.Resume``), the model sized for the data and compiled where
    ``compile=true``, the task around it saving the resolved config in its checkpoints,
    and the checkpoint's weights held to the task; with ``fingerprint``, what the seed
    fixed (``seeded``)."""
    use_cpu(cfg)
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    checkpoint = resume.checkpoint if resume is not None else None
    run_config = (resume.run_config or None) if resume is not None else None
    datamodule = build_datamodule(cfg.data, checkpoint)
    model = build_model(cfg.model, datamodule)
    compiled = compile_model(model) if cfg.get("compile") else None  # its weights as built
    task = build_task(cfg.task, model, datamodule, run_config=run_config)
    if resume is not None:  # its tensors fit (a checkpoint with no saved config too)
        resume.check_weights(task)
    start = seeded(model, (run_config or {}).get("data")) if fingerprint else None
    if compiled:
        say(compiled)
    return Components(datamodule, model, task, compiled, start)


class Restored(NamedTuple):
    """A checkpoint brought back: the checkpoint, its data module (the tokenizer it was
    trained with) and its task, weights loaded (``task.model`` is the network)."""

    checkpoint: SavedCheckpoint
    datamodule: L.LightningDataModule
    task: Any


def restore(checkpoint: SavedCheckpoint, run: DictConfig) -> Restored:
    """The one way back from a checkpoint (``tlab-eval``, ``tlab-sample``,
    ``tlab-translate``, every evaluation length, ``checkpoints.load_task``): the saved
    run's data module, model and task built as ``run`` says (the checkpoint's config with
    the caller's overrides: ``SavedCheckpoint.run_config``), the weights checked and
    loaded from the checkpoint already read."""
    parts = build_components(run, Resume({}, checkpoint, against=run))
    parts.task.load_state_dict(checkpoint.state_dict)
    return Restored(checkpoint, parts.datamodule, parts.task.eval())


def use_cpu(cfg: DictConfig) -> None:
    """Give torch the run's ``cpu_threads`` (null: torch's default), so that runs that share
    a machine do not each take all of its cores; and with ``keep_freed_memory`` (true
    unless set false), have malloc reuse freed tensors' memory rather than fault in fresh
    pages for each large one (``run.memory``)."""
    if cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    if cfg.get("keep_freed_memory", True):
        keep_freed_memory()


def digest(data: bytes) -> str:
    """A short fingerprint of some bytes (12 hex digits of SHA-1)."""
    return hashlib.sha1(data).hexdigest()[:12]


def seeded(model: torch.nn.Module, data_config: Any) -> dict[str, Any]:
    """What a run's seed fixed before training, so that a summary pairs two runs by seed
    only where the seed made them alike: the data (its resolved config: every data
    module is generated or split from its own config), torch's random state once the
    model is built (the order of the training batches is drawn from it), and each
    parameter's initial values, by name. A kernel with parameters of its own (Based's
    projections) draws them between the layers' and shifts everything drawn after."""
    params = {
        name: digest(p.detach().cpu().float().contiguous().numpy().tobytes())
        for name, p in model.named_parameters()
    }
    return {
        "data": digest(json.dumps(data_config, sort_keys=True, default=str).encode()),
        "rng": digest(torch.get_rng_state().numpy().tobytes()),
        "params": params,
    }
