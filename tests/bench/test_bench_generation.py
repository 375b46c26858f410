"""The generation benchmark runs end to end and reports what the caches hold."""

import csv

import pytest

from transformers_lab.attention import KERNELS
from transformers_lab.attention.resolve import kernel_class_at
from transformers_lab.bench import generation
from transformers_lab.bench.kernels import PATH_VARIANTS, default_variants, variant_configs


def test_generation_bench_writes_reports(tmp_path):
    argv = [
        "--context",
        "8",
        "40",
        "--kernels",
        "softmax",
        "fastmax",
        "--new-tokens",
        "3",
        "--n-layer",
        "1",
        "--d-model",
        "16",
        "--n-head",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert generation.main(argv) == 0
    rows = list(csv.DictReader((tmp_path / "generation.csv").open()))
    assert [(r["kernel"], r["context"]) for r in rows] == [
        ("softmax", "8"),
        ("softmax", "40"),
        ("fastmax", "8"),
        ("fastmax", "40"),
    ]
    assert all(float(r["ms_per_token"]) > 0 for r in rows)
    cache = {(r["kernel"], r["context"]): float(r["cache_mib"]) for r in rows}
    assert cache[("softmax", "40")] > cache[("softmax", "8")]  # the KV cache grows
    assert cache[("fastmax", "40")] == cache[("fastmax", "8")]  # the state does not
    state = {(r["kernel"], r["context"]): int(r["state_size"]) for r in rows}
    assert state[("softmax", "40")] == 1 * 2 * 16 * (40 + 3)  # layers x (k, v) x width x n
    assert state[("fastmax", "40")] == state[("fastmax", "8")]
    # the cache really holds that many float32 numbers
    assert cache[("softmax", "40")] == pytest.approx(state[("softmax", "40")] * 4 / 2**20)


def test_past_the_trained_context_neither_cache_grows(tmp_path, capsys):
    """--trained-at 8: contexts of 8 and 40 tokens decoded on the state past 8; softmax's
    KV cache slides a window of 8 (7 kept + the new key), GLA's state is constant, and
    cosFormer, whose positions end at its max_len, is said and left out."""
    small = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--new-tokens", "3"]
    argv = ["--trained-at", "8", "--context", "8", "40", "--kernels", "softmax", "gla"]
    argv += ["cosformer", *small, "--out", str(tmp_path)]
    assert generation.main(argv) == 0
    assert "cosformer: left out, it cannot decode past its context" in capsys.readouterr().err
    rows = list(csv.DictReader((tmp_path / "generation.csv").open()))
    cache = {(r["kernel"], r["context"]): float(r["cache_mib"]) for r in rows}
    assert set(cache) == {("softmax", "8"), ("softmax", "40"), ("gla", "8"), ("gla", "40")}
    assert cache[("softmax", "40")] == cache[("softmax", "8")]  # the window, not the context
    assert cache[("softmax", "40")] == pytest.approx(1 * 2 * 16 * 8 * 4 / 2**20)
    assert cache[("gla", "40")] == cache[("gla", "8")]
    state = {(r["kernel"], r["context"]): int(r["state_size"]) for r in rows}
    assert state[("softmax", "40")] == state[("softmax", "8")] == 1 * 2 * 16 * 8  # the window
    assert "trained at 8 (RoPE), decoded past it" in (tmp_path / "generation.md").read_text()


def test_every_attention_option_generates_by_default(tmp_path):
    argv = ["--context", "4", "12", "--new-tokens", "2", "--n-layer", "1", "--d-model", "8"]
    assert generation.main([*argv, "--n-head", "2", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "generation.csv").open()))
    options = [n for n in default_variants() if n not in PATH_VARIANTS]
    assert sorted({r["kernel"] for r in rows}) == sorted(options)
    configs = variant_configs(options)
    classes = {kernel_class_at(c["_target_"]) for c in configs.values()}
    assert {
        cls for cls in KERNELS.values() if cls.__module__.startswith("transformers_lab")
    } <= classes
    for name, config in configs.items():
        sizes = [int(r["state_size"]) for r in rows if r["kernel"] == name]
        assert (sizes[0] == sizes[1]) == kernel_class_at(config["_target_"]).constant_state, name
    assert "ms / token" in (tmp_path / "generation.md").read_text()


def test_unknown_kernel_is_refused():
    with pytest.raises(SystemExit):
        generation.main(["--kernels", "nope"])
