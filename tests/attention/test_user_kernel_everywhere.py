"""A user's kernel is first-class everywhere a built-in one is: glob sweeps, the three
benches, the check, the printed resume command, the README's table. The kernel is
``tests/user/user_kernels/relu2.py`` (ReLU² linear attention, outside the package) with its
yaml in ``tests/user/my_conf/attention/``, found through the config dir as a user's is."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from transformers_lab.attention import AttentionKernel, masked_softmax
from transformers_lab.attention.__main__ import kernel_table
from transformers_lab.attention.check import check_kernel, checks_for
from transformers_lab.attention.resolve import (
    UnknownKernel,
    config_dirs,
    kernel_config,
    kernel_factory,
)
from transformers_lab.attention.testbed import build
from transformers_lab.bench import generation, long_context
from transformers_lab.bench import kernels as bench
from transformers_lab.check import main as check_main
from transformers_lab.config import searchpath_override
from transformers_lab.nn.check import layer_failures

USER = Path(__file__).parents[1] / "user"
MY_CONF = USER / "my_conf"
CLASS = "user_kernels.relu2.ReLU2Attention"
YAML = str(MY_CONF / "attention" / "relu2.yaml")


@pytest.fixture
def user_path(monkeypatch):
    """The user's package importable, in this process and in the benches' workers."""
    monkeypatch.syspath_prepend(str(USER))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(USER), os.environ.get("PYTHONPATH", "")]))


def test_every_way_of_naming_the_kernel_gives_its_config(user_path):
    dirs = config_dirs([MY_CONF])
    by_name = kernel_config("relu2", dirs)
    assert by_name == kernel_config(YAML) == {**kernel_config(CLASS), **by_name}
    assert by_name["_target_"] == CLASS and by_name["_partial_"] is True
    assert kernel_config("fastmax_p2")["p"] == 2  # an option of the package's own group
    assert kernel_config("fastmax_p1", options={"chunk_size": 8})["chunk_size"] == 8
    with pytest.raises(UnknownKernel, match="unknown kernel 'relu3'.*--config-dir DIR"):
        kernel_config("relu3")
    with pytest.raises(UnknownKernel, match="no attention/ folder in the config dir"):
        config_dirs([USER])


def test_a_kernel_yaml_that_needs_its_config_says_how_to_name_it(tmp_path):
    (tmp_path / "attention").mkdir()
    yaml = tmp_path / "attention" / "sized.yaml"
    yaml.write_text(f"_target_: {CLASS}\n_partial_: true\nchunk_size: ${{data.block_size}}\n")
    with pytest.raises(UnknownKernel, match=f"--config-dir {tmp_path}\\) and name it sized"):
        kernel_config(str(yaml))


@pytest.mark.parametrize(
    "argv",
    [
        ["relu2", "--config-dir", str(MY_CONF)],
        ["relu2", f"hydra.searchpath=[file://{MY_CONF}]"],
        [YAML],
        [CLASS],
        ["fastmax_p2"],  # an option of the attention group inside the package
    ],
    ids=["name", "searchpath", "yaml", "class", "fastmax_p2"],
)
def test_the_check_takes_every_name_the_attention_group_takes(argv, user_path, capsys):
    assert check_main(argv) == 0
    # every check the checker gives the kernel (no layer parts: no layer checks), counted
    factory = kernel_factory(argv[0], dirs=config_dirs([MY_CONF]))
    ran = checks_for(build(factory))
    assert ran and layer_failures(factory) == ([], [])
    assert passed(capsys.readouterr().out, argv[0]) == ran


def passed(out: str, target: str) -> list[str]:
    """The checks an ``ok`` line says TARGET passed, its count checked against them."""
    ok = re.fullmatch(rf"ok: {re.escape(target)} passes the (\d+) checks \((.*)\)\n", out)
    assert ok and int(ok[1]) == len(ok[2].split(", ")), out
    return ok[2].split(", ")


def test_the_users_kernel_takes_the_layers_parts(user_path, capsys, tmp_path):
    """attention.short_conv=4 works with a kernel of the user's, which declares nothing for
    it: the check runs the layer checks, and a run trains with it."""
    assert check_main(["relu2", "short_conv=4", "--config-dir", str(MY_CONF)]) == 0
    ran = passed(capsys.readouterr().out, "relu2")
    # the kernel's own checks (short_conv is the layer's), then the layer's around it
    contract = checks_for(build(kernel_factory("relu2", dirs=config_dirs([MY_CONF]))))
    assert ran[: len(contract)] == contract and "layer decode" in ran[len(contract) :]
    assert all(name.startswith("layer ") for name in ran[len(contract) :])
    from transformers_lab.config import compose_config
    from transformers_lab.run.fit import fit_and_test

    overrides = [
        "experiment=mqar", "attention=relu2", "attention.short_conv=4", "debug=fdr",
        "logger=csv", *searchpath_override([MY_CONF]),
    ]  # fmt: skip
    outcome = fit_and_test(compose_config("train", overrides, tmp_path / "run"))
    assert outcome.layers == ["relu2(short_conv=4)"] * 2


def test_a_hybrid_stack_names_the_users_kernel_found_on_the_searchpath(user_path, tmp_path):
    """``model.hybrid={1: relu2}`` finds relu2 where ``attention=relu2`` does: in the config
    dirs of the run's ``hydra.searchpath``."""
    from transformers_lab.config import compose_config
    from transformers_lab.run.fit import fit_and_test

    overrides = [
        "experiment=mqar", "attention=softmax", "model.hybrid={1: relu2}", "debug=fdr",
        "logger=csv", *searchpath_override([MY_CONF]),
    ]  # fmt: skip
    outcome = fit_and_test(compose_config("train", overrides, tmp_path / "run"))
    assert outcome.layers == ["softmax", "relu2"]


class FormulaOnly(AttentionKernel, register=False):
    """A kernel that writes its weights from the formula and has no reference."""

    name = "formula_only"

    def weights(self, q, k, *, causal=False, key_padding_mask=None):
        from transformers_lab.attention import attention_mask

        allowed = attention_mask(
            q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
            device=q.device,
        )  # fmt: skip
        return masked_softmax(q @ k.transpose(-2, -1) / self.head_dim**0.5, allowed)


def test_a_kernel_without_reference_weights_is_told_so_and_weights_is_not_blamed():
    failures = check_kernel(FormulaOnly)
    assert failures == [
        "reference: FormulaOnly defines no reference_weights: write the weights from the "
        "kernel's formula, naively in float64 (attention.naive has the masks and the row "
        "sums); forward and weights are held against it"
    ]


@pytest.mark.slow  # over a minute on 2 cores: make test-slow
def test_the_kernel_bench_measures_the_users_kernel(user_path, tmp_path):
    args = bench.parse_args(
        ["--kernels", "softmax", "relu2", YAML, CLASS, "--config-dir", str(MY_CONF),
         "--n", "32", "--causal", "causal", "--repeats", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    assert args.kernels == ["softmax", "relu2", YAML, CLASS]
    assert args.configs["relu2"]["_target_"] == CLASS
    rows = bench.run_bench(args)  # each in its own worker process
    assert [(r["variant"], r["status"]) for r in rows] == [
        ("softmax", "ok"), ("relu2", "ok"), (YAML, "ok"), (CLASS, "ok")
    ]  # fmt: skip
    relu2 = rows[1]
    assert relu2["time_ms"] > 0 and relu2["state_numbers"] == 4 * 33 * 32  # H (Dv + 1) D
    with pytest.raises(SystemExit):
        bench.parse_args(["--kernels", "relu3"])  # unknown: the list of valid ones


def test_the_generation_bench_decodes_with_the_users_kernel(user_path, tmp_path):
    argv = ["--kernels", "relu2", "softmax", "--config-dir", str(MY_CONF), "--context", "4",
            "12", "--new-tokens", "2", "--n-layer", "1", "--d-model", "8", "--n-head", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert generation.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "generation.csv").open()))
    sizes = {(r["kernel"], r["context"]): int(r["state_size"]) for r in rows}
    assert sizes[("relu2", "4")] == sizes[("relu2", "12")]  # a linear kernel's state
    assert sizes[("softmax", "4")] < sizes[("softmax", "12")]


def test_the_long_context_bench_takes_the_users_kernel(user_path):
    dirs = config_dirs([MY_CONF])
    # None: an option of the valid ones (relu2 among them), composed as attention=relu2;
    # an unknown kernel's error: tests/bench/test_bench_long_context.py
    configs = long_context.kernel_configs(["relu2", "softmax", CLASS], dirs)
    assert configs == {"relu2": None, "softmax": None, CLASS: kernel_config(CLASS)}
    assert searchpath_override(dirs) == [f"hydra.searchpath=[file://{MY_CONF.resolve()}]"]


@pytest.mark.skipif(not os.environ.get("TLAB_DATA_DIR"), reason="needs Tiny Shakespeare")
def test_the_long_context_bench_trains_the_users_kernel(user_path, tmp_path):
    """Its class, named by its dotted path (its yaml, relu2 in the user's config dir, is
    trained by the README's long-context command, in the slow suite)."""
    argv = ["--kernels", CLASS, "--config-dir", str(MY_CONF), "--steps", "1",
            "--warmup", "0", "--out", str(tmp_path), "--overrides", "data.block_size=32",
            "data.batch_size=2", "model.n_layer=1"]  # fmt: skip
    assert long_context.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "long_context.csv").open()))
    assert [(r["kernel"], r["status"]) for r in rows] == [(CLASS, "ok")]


def test_the_readme_table_has_the_users_kernel_with_their_config_dir(user_path):
    # without their config dir, the table leaves it out: test_attention_kernels.py's
    row = next(line for line in kernel_table([MY_CONF]).splitlines() if "`relu2`" in line)
    assert "φ = relu² + ε" in row and "constant: 4,160 numbers a head" in row


@pytest.mark.slow  # a joblib multirun through tlab-train
def test_a_glob_sweep_runs_the_users_kernel(tmp_path):
    """``attention=glob(...)`` lists the options of every config dir, the user's too (Hydra's
    own sweeper lists only those it started with: relu2 was silently left out), and the
    joblib launcher's workers take the sweeper's loader as it pickles."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(USER)}
    proc = subprocess.run(
        [sys.executable, "-m", "transformers_lab.train", "-m", "attention=glob(relu*)",
         "launcher=joblib", "experiment=mqar", "debug=fdr", "logger=csv",
         "trainer.enable_progress_bar=false",
         f"hydra.searchpath=[file://{MY_CONF}]", f"hydra.sweep.dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (tmp_path / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["overrides"].split()[0], r["status"]) for r in rows) == [
        ("attention=relu", "ok"), ("attention=relu2", "ok")
    ]  # fmt: skip
