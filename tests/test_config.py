"""config: resolvers, composing from Python, and instantiating with the target's error."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from transformers_lab.config import (
    attention_configs,
    compose_config,
    flatten,
    optuna_direction,
)
from transformers_lab.errors import ConfigError
from transformers_lab.run.checkpoints import resolved_sections


def test_resolvers():
    assert optuna_direction("min") == "minimize" and optuna_direction("max") == "maximize"
    with pytest.raises(ConfigError, match="monitor.mode must be min or max, got 'up'"):
        optuna_direction("up")
    cfg = OmegaConf.create({"a": "${run_id:}", "b": "${run_id:}"})
    first = cfg.a
    assert len(first) == 6 and cfg.a == first == cfg.b  # drawn once per config
    other = OmegaConf.create({"a": "${run_id:}"})
    assert other.a != first  # and afresh for another (1 in 16**6 to collide)
    # Zoology's cosine over 64 epochs of 100k examples at batch 512: 196 steps an epoch
    cfg = OmegaConf.create({"n": 100_000, "b": 512, "steps": "${epoch_steps:64,${n},${b}}"})
    assert cfg.steps == 64 * 196
    with pytest.raises(Exception, match="epoch_steps needs positive epochs"):
        OmegaConf.to_container(OmegaConf.create({"s": "${epoch_steps:64,0,512}"}), resolve=True)


def test_the_kernel_bench_imports_no_lightning():
    """Each bench measurement is a process of its own: Lightning's imports (some 10 s on
    2 busy cores) would outweigh a small measurement."""
    code = "import sys, transformers_lab.bench.kernels; print('lightning' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]


def test_compose_flatten_and_sections(tmp_path):
    cfg = compose_config("train", ["model=gpt", "data=mqar"], tmp_path / "run")
    assert cfg.paths.output_dir == str(tmp_path / "run")
    sections = resolved_sections(cfg)
    assert set(sections) == {"model", "data", "task"} and isinstance(sections["model"], dict)
    flat = flatten(sections)
    assert flat["model._target_"] == "transformers_lab.models.GPT"
    assert flatten({"a": {"b": [1, 2]}, "c": {}}) == {"a.b": [1, 2]}


def test_attention_configs_are_every_option_of_the_group():
    configs = attention_configs()
    assert {"softmax", "fastmax", "linear", "cosformer"} <= set(configs)
    assert configs["fastmax"]["_target_"].endswith("FastmaxAttention")


def test_the_tasks_of_a_several_task_srun_share_one_run_dir(monkeypatch, tmp_path):
    """srun's tasks start at once, each composing its config: one run dir for all, named
    by the job and step (found again when SLURM requeues the job), and Hydra's config of
    each task but the first in a folder of its own. One task, or none: the usual name."""
    from hydra import compose, initialize_config_dir

    from transformers_lab.config import CONF_DIR

    for key in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
                "SLURM_STEP_ID"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))

    def dirs() -> tuple[str, str]:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", return_hydra_config=True)
        return cfg.hydra.run.dir.rsplit("/", 1)[1], cfg.hydra.output_subdir

    alone = dirs()
    assert not alone[0].startswith("slurm") and alone[1] == ".hydra"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert not dirs()[0].startswith("slurm")  # a batch script's command, not srun's tasks
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert not dirs()[0].startswith("slurm")  # one task: a job of the sweep launcher
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert dirs() == ("slurm-77.0", ".hydra")
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert dirs() == ("slurm-77.0", ".hydra.rank1")
