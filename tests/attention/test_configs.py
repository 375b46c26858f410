"""The Hydra configs of the kernels instantiate into kernel factories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from transformers_lab.attention import KERNELS, AttentionKernel
from transformers_lab.nn.parts import PART_KEYS, split_layer_parts

CONF = Path(__file__).resolve().parents[2] / "conf"


OPTIONS = sorted(p.stem for p in (CONF / "attention").glob("*.yaml"))
# the project's own kernels: a user's kernel that another test imported registers too
OWN = {name: cls for name, cls in KERNELS.items() if cls.__module__.startswith("transformers_lab.")}


def test_every_registered_kernel_has_its_config():
    assert len(OWN) >= 15 and set(OWN) <= set(OPTIONS)


@pytest.mark.parametrize("option", OPTIONS)
def test_every_attention_option_composes_into_a_registered_kernel(tmp_path, option):
    """A variant (fastmax_p1) is a yaml of a registered kernel with other settings."""
    (tmp_path / "attention").symlink_to(CONF / "attention")
    (tmp_path / "probe.yaml").write_text("defaults:\n  - attention: softmax\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose("probe", overrides=[f"attention={option}"])
    factory, _ = split_layer_parts(instantiate(cfg.attention))  # the layer's switches aside
    kernel = factory(head_dim=4, n_head=2)
    assert type(kernel) in KERNELS.values()
    settings = {k: v for k, v in cfg.attention.items() if not k.startswith("_") and v is not None}
    kept = {k: v for k, v in settings.items() if hasattr(kernel, k)}  # some set other fields
    assert all(getattr(kernel, key) == value for key, value in kept.items()), kept


@pytest.mark.parametrize("name", sorted(OWN))
def test_kernel_config_instantiates_a_factory(name):
    cfg = OmegaConf.load(CONF / "attention" / f"{name}.yaml")
    assert cfg._partial_ is True
    factory, _ = split_layer_parts(instantiate(cfg))
    kernel = factory(head_dim=8, n_head=2)
    assert isinstance(kernel, AttentionKernel) and isinstance(kernel, KERNELS[name])
    q = torch.randn(1, 2, 5, kernel.qk_dim)  # Based's q and k are feature_dim wide
    steps = 5 * kernel.keys_per_token  # Gated DeltaProduct's n_h keys a token
    k, v = torch.randn(1, 2, steps, kernel.qk_dim), torch.randn(1, 2, steps, 8)
    gates = kernel.sample_gates(1, 5)  # a gated kernel's inputs, which its layer projects
    assert kernel(q, k, v, causal=True, **gates).shape == (1, 2, 5, 8)


def test_config_keys_match_the_kernel_signature():
    """A stale option in a YAML file fails here, not in a user's run."""
    import inspect

    for name, cls in OWN.items():
        cfg = OmegaConf.load(CONF / "attention" / f"{name}.yaml")
        params = inspect.signature(cls).parameters
        options = {k for k in cfg if not k.startswith("_") and k not in PART_KEYS}  # the layer's
        assert options <= set(params), f"{name}.yaml has options {options - set(params)}"


def test_fastmax_options_override_from_the_command_line(tmp_path):
    (tmp_path / "attention").symlink_to(CONF / "attention")
    (tmp_path / "probe.yaml").write_text("defaults:\n  - attention: softmax\n  - _self_\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose("probe", overrides=["attention=fastmax", "attention.p=1"])
    factory, _ = split_layer_parts(instantiate(cfg.attention))  # the layer's switches aside
    kernel = factory(head_dim=4, n_head=2)
    assert type(kernel).__name__ == "FastmaxAttention" and kernel.p == 1


def test_the_layers_switches_are_one_list_in_the_code_and_the_configs():
    """``conf/layer/parts.yaml`` (what every attention option composes with, and what the
    kernel check and the kernel table leave to the layer) holds exactly the layer's own
    switches (``nn.parts.LayerParts``), at their defaults."""
    from dataclasses import asdict

    from transformers_lab.config import layer_part_defaults
    from transformers_lab.nn.parts import LayerParts

    assert layer_part_defaults() == asdict(LayerParts())
    assert tuple(layer_part_defaults()) == PART_KEYS
