"""A kernel of the user's own, as the README writes it: one file in their package and one
yaml in their config dir, no file of the project edited. It passes the check, trains,
builds into every model and runs in a sweep."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate

from tests.end_to_end.test_readme import readme_block  # the README's code blocks
from transformers_lab.attention import KERNELS, AttentionKernel
from transformers_lab.attention.check import checks_for
from transformers_lab.attention.resolve import kernel_factory
from transformers_lab.attention.testbed import build
from transformers_lab.cli import check_overrides
from transformers_lab.config import CONF_DIR, compose_config
from transformers_lab.errors import ConfigError
from transformers_lab.nn.check import layer_failures
from transformers_lab.run.components import build_datamodule, build_model

from fake_data import fake_data_root


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """my_kernels/distance.py and my_conf/attention/distance.yaml, from the README."""
    root = tmp_path_factory.mktemp("user")
    (root / "my_kernels").mkdir()
    (root / "my_kernels" / "__init__.py").write_text("")
    (root / "my_kernels" / "distance.py").write_text(readme_block("# my_kernels/distance.py"))
    (root / "my_conf" / "attention").mkdir(parents=True)
    yaml = readme_block("# my_conf/attention/distance.yaml")
    (root / "my_conf" / "attention" / "distance.yaml").write_text(yaml)
    return root


def run(*args: str, cwd: Path, program: str = sys.executable) -> subprocess.CompletedProcess:
    """``program`` (python, or a script of this venv) with ``args``, run from ``cwd``."""
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(cwd)}
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [program, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def searchpath(user_dir: Path) -> str:
    return f"hydra.searchpath=[file://{user_dir / 'my_conf'}]"


def test_the_users_kernel_passes_the_check(user_dir, monkeypatch, capsys):
    """tlab-check with the class, run as the README runs it, from the user's folder; with
    the yaml, in this process (``check.main``, what tlab-check runs)."""
    from transformers_lab.check import main as check_main

    monkeypatch.syspath_prepend(str(user_dir))
    # every check the checker gives the kernel (no layer parts: no layer checks), counted
    factory = kernel_factory("my_kernels.distance.DistanceAttention")
    ran = checks_for(build(factory))
    assert ran and layer_failures(factory) == ([], [])
    cls = "my_kernels.distance.DistanceAttention"
    proc = run(cls, cwd=user_dir, program=str(Path(sys.executable).parent / "tlab-check"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    monkeypatch.chdir(user_dir)
    yaml = "my_conf/attention/distance.yaml"
    assert check_main([yaml]) == 0
    for target, out in ((cls, proc.stdout), (yaml, capsys.readouterr().out)):
        said = rf"ok: {re.escape(target)} passes the (\d+) checks \((.*)\)\n"
        ok = re.fullmatch(said, out)
        assert ok and int(ok[1]) == len(ran) and ok[2].split(", ") == ran, out


def test_the_users_kernel_is_known_by_the_preflight(user_dir):
    """(It trains through tlab-train: the sweep's test below.)"""
    with pytest.raises(ConfigError, match="unknown attention 'distanse'; valid options are: .*"):
        check_overrides(["attention=distanse", searchpath(user_dir)])
    with pytest.raises(ConfigError) as err:
        check_overrides(["attention=distanse", searchpath(user_dir)])
    assert "distance, dot" in str(err.value) and str(user_dir / "my_conf" / "attention") in str(
        err.value
    )
    check_overrides(["attention=distance", searchpath(user_dir)])  # accepted
    with pytest.raises(ConfigError, match="unknown attention 'distance'"):
        check_overrides(["attention=distance"])  # without the user's dir it is unknown


@pytest.mark.parametrize("model", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
def test_every_model_builds_with_the_users_kernel(user_dir, model, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(user_dir))
    monkeypatch.delenv("TLAB_ROOT", raising=False)
    fake_data_root(tmp_path / "data", monkeypatch)  # Multi30k for the Transformer
    data = {"gpt": "mqar", "vit": "digits", "encoder": "digits", "transformer": "multi30k"}
    overrides = [f"model={model}", f"data={data[model]}", "attention=distance"]
    cfg = compose_config("train", [*overrides, searchpath(user_dir)], tmp_path / "run")
    assert instantiate(cfg.attention).func.__name__ == "DistanceAttention"
    built = build_model(cfg.model, build_datamodule(cfg.data))
    kernels = [m for m in built.modules() if isinstance(m, AttentionKernel)]
    assert kernels and all(type(m).name == "distance" for m in kernels), model
    assert KERNELS["distance"].__module__ == "my_kernels.distance"


@pytest.mark.slow  # an end-to-end run through tlab-train (make test-slow)
def test_a_sweep_with_the_users_kernel_writes_its_summary(user_dir):
    proc = run(
        "-m", "transformers_lab.train", "-m", "attention=distance,softmax", "experiment=mqar",
        "debug=limit", "logger=csv", "trainer.enable_progress_bar=false", searchpath(user_dir),
        "hydra.sweep.dir=sweep", cwd=user_dir,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (user_dir / "sweep" / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["overrides"].split()[0], r["status"]) for r in rows] == [
        ("attention=distance", "ok"),
        ("attention=softmax", "ok"),
    ]
    assert float(rows[0]["val/acc"]) >= 0
