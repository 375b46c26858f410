"""A kernel named the way every tool takes it: the check, the benches, the README's table.

A TARGET is, in this order:

- a kernel yaml (``my_conf/attention/relu2.yaml``), as the attention group holds them;
- an option of the ``attention`` config group (``fastmax_p2``; ``relu2`` from a user's
  config dir given by ``--config-dir`` or ``hydra.searchpath=[file://...]``), composed as
  ``attention=<name>`` composes it;
- a registered kernel name (``fastmax``), with the class's defaults;
- a class path, ``package.module.Class``.

Each becomes the same thing, a kernel config: a plain dict with ``_target_`` and
``_partial_: true`` that ``hydra.utils.instantiate`` turns into a factory
``f(head_dim=, n_head=)`` (``kernel_factory``; ``layer_factory`` keeps the layer's switches
the config carries). A config is what a worker process or a run rebuilds a kernel from,
so a user's kernel travels as its config, not as its name.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from transformers_lab.attention.base import REGISTRY, AttentionKernel, qualified_name
from transformers_lab.config import (
    CONF_DIR,
    attention_configs,
    group_options,
    layer_part_defaults,
    search_dirs,
)


class UnknownKernel(ValueError):
    """A target that names no kernel: one line with what is valid and how to add a dir."""


def config_dirs(config_dir: Sequence[str | Path] = (), argv: Sequence[str] = ()) -> list[Path]:
    """``conf/`` and the user's config dirs: each ``config_dir``, and those that
    ``hydra.searchpath=[file://DIR,...]`` or ``--config-dir DIR`` in ``argv`` name."""
    dirs = search_dirs([*argv, *(f"--config-dir={d}" for d in config_dir)])
    if dirs is None:
        raise UnknownKernel(f"cannot find every config dir of {' '.join(argv)}; give file://DIR")
    missing = [d for d in dirs if not (d / "attention").is_dir()]
    if missing:
        raise UnknownKernel(
            f"no attention/ folder in the config dir {missing[0]}: give the dir that holds "
            "attention/<name>.yaml, as on hydra.searchpath"
        )
    return [d.resolve() for d in dirs]


def kernel_names(dirs: Sequence[Path] = (CONF_DIR,)) -> list[str]:
    """Every name a TARGET may be: the attention options of ``dirs``, then the registered
    kernels that are no option."""
    options = group_options("attention", dirs)
    return options + sorted(set(REGISTRY) - set(options))


def kernel_config(
    target: str, dirs: Sequence[Path] = (CONF_DIR,), options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The kernel config (``_target_``, ``_partial_: true`` and options) that TARGET names,
    ``options`` merged over it. ``dirs``: ``conf/`` and the user's config dirs."""
    options = dict(options or {})
    if target.endswith((".yaml", ".yml")):
        path = Path(target)
        if not path.is_file():
            raise UnknownKernel(f"no kernel config at {path}")
        try:
            config = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        except OmegaConfBaseException as exc:  # ${...} of a config it is not composed in
            raise UnknownKernel(
                f"{path} cannot be read on its own ({str(exc).splitlines()[0]}): put its dir "
                f"on the search path (--config-dir {path.parent.parent}) and name it {path.stem}"
            ) from None
        if not isinstance(config, dict) or "_target_" not in config:
            raise UnknownKernel(f"{path} is no kernel config: it needs a _target_ (a class path)")
        if "defaults" in config:
            raise UnknownKernel(
                f"{path} has a defaults list, which only Hydra composes: put its dir on the "
                f"search path (--config-dir {path.parent.parent}) and name it {path.stem}"
            )
    elif target in group_options("attention", dirs):
        config = attention_configs(dirs, [target])[target]
    elif target in REGISTRY:
        config = {"_target_": qualified_name(REGISTRY[target])}
    elif "." in target:
        config = {"_target_": target}
    else:
        near = difflib.get_close_matches(target, kernel_names(dirs), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        where = ", ".join(str(d / "attention") for d in dirs if d != CONF_DIR)
        raise UnknownKernel(
            f"unknown kernel {target!r}{hint}; valid: {', '.join(kernel_names(dirs))} "
            f"(conf/attention/{', ' + where if where else ''}), a kernel yaml, or a class "
            "as package.module.Class; a kernel of your own config dir needs --config-dir DIR "
            "(or hydra.searchpath=[file://DIR])"
        )
    kernel_class_at(config["_target_"])  # importable, and a kernel
    return {**config, "_partial_": True, **options}


def kernel_class_at(path: str) -> type[AttentionKernel]:
    """The AttentionKernel subclass at the dotted ``path`` (importing its module registers
    it)."""
    module_name, _, class_name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownKernel(
            f"cannot import {module_name} for {path} ({exc}); run from the folder that holds "
            "your package, or put it on PYTHONPATH"
        ) from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, AttentionKernel)):
        raise UnknownKernel(f"{path} is not an AttentionKernel subclass")
    return cls


def kernel_factory(
    target: str, options: dict[str, Any] | None = None, dirs: Sequence[Path] = (CONF_DIR,)
) -> Callable[..., AttentionKernel]:
    """A factory ``f(head_dim=, n_head=)`` for TARGET with ``options``. The layer's
    switches an attention config carries (``short_conv=4``: ``conf/layer/parts.yaml``) are
    left out: they are the layer's (``layer_factory``)."""
    switches = layer_part_defaults()
    config = kernel_config(target, dirs, options)
    return instantiate({k: v for k, v in config.items() if k not in switches})


def layer_factory(
    target: str, options: dict[str, Any] | None = None, dirs: Sequence[Path] = (CONF_DIR,)
) -> Callable[..., Any]:
    """``kernel_factory``'s kernel with the layer's switches its config carries, as the
    multi-head layer takes it (``nn.multihead``)."""
    return instantiate(kernel_config(target, dirs, options))


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` kernel options of a command line, the values read as yaml
    (``hydra.searchpath`` aside: it names config dirs, ``config_dirs``)."""
    options = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"options are key=value, got {pair!r}")
        if key.lstrip("+") != "hydra.searchpath":
            options[key] = yaml.safe_load(value)
    return options
