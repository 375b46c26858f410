"""MAD's six synthetic tasks (Poli et al., 2024): each generator against a plain reading of
MAD's rules, determinism, the data module's refusals, the bottleneck model of the
compression task, and a fast run of every task through tlab-train."""

from __future__ import annotations

import csv

import pytest
import torch

from tests.sweeps.test_sweeps import sweep_dir_of, tlab_train
from transformers_lab.data.base import IGNORE
from transformers_lab.data.mad import (
    GENERATORS,
    MAD_PROBLEMS,
    MADDataModule,
    compression,
    fuzzy_recall,
    in_context_recall,
    memorization,
    memorization_map,
    noisy_recall,
    selective_copying,
)
from transformers_lab.models import GPT
from transformers_lab.sweeps.report.cli import summarize


def recall_reference(seq: list[int], keys: int, noise_from: int) -> list[int]:
    """MAD's test targets of a whole (noisy) in-context recall sequence, read pair by
    pair: a value is asked when its key was shown before in a pair; the probe's always."""
    shown, targets = set(), []
    for i in range(0, len(seq) - 2, 2):
        key, value = seq[i], seq[i + 1]
        if key >= noise_from:  # a noise slot
            targets += [IGNORE, IGNORE]
            continue
        assert key < keys <= value < noise_from
        targets += [IGNORE, value if key in shown else IGNORE]
        shown.add(key)
    assert seq[-2] in shown  # the probe's key was shown
    return [*targets, IGNORE, seq[-1]]


@pytest.mark.parametrize("frac_noise", [0.0, 0.5])
def test_in_context_recall_asks_for_the_values_of_keys_seen_before(frac_noise):
    vocab, noise = (16, 0) if frac_noise == 0 else (32, 16)
    x, y = in_context_recall(
        200, vocab, 32, training=False, seed=3, frac_noise=frac_noise, noise_vocab_size=noise
    )
    assert x.shape == y.shape == (200, 31)  # MAD reads seq_len - 1 tokens
    keys = (vocab - noise) // 2
    for inputs, labels in zip(x.tolist(), y.tolist(), strict=True):
        seq = [*inputs, labels[-1]]  # the inputs, and the probe's value they end before
        assert labels == recall_reference(seq, keys, vocab - noise)[1:]  # the shift
        probe_key = inputs[-1]
        assert labels[-1] == inputs[inputs.index(probe_key) + 1]  # the probe's bound value
        pairs = {}  # a key keeps its value within a sequence
        for k, v in zip(inputs[0:-1:2], inputs[1::2], strict=False):
            if k < keys:
                assert pairs.setdefault(k, v) == v
    supervised = (y != IGNORE).float().mean()
    assert 0.05 < supervised < 0.5


def test_training_recall_targets_are_the_shifted_inputs_as_in_mad():
    x, y = in_context_recall(50, 16, 32, training=True, seed=0)
    assert torch.equal(x[:, 1:], y[:, :-1]) and not (y == IGNORE).any()
    xt, _ = in_context_recall(50, 16, 32, training=False, seed=0)
    assert torch.equal(x, xt)  # the same sequences, only the targets differ


def test_noisy_recall_noise_is_never_asked_and_has_its_rate():
    x, y = noisy_recall(2000, seed=1, training=False, frac_noise=0.4)
    noise = x >= 16  # MAD's defaults: vocab 32, the last 16 ids are noise
    assert not ((y != IGNORE) & noise).any()
    pairs = noise[:, 0:-1:2][:, :-1]  # the slots before the probe
    assert pairs.float().mean().item() == pytest.approx(0.4, abs=0.02)
    assert (~pairs).any(1).all()  # at least one real pair in every sequence


def test_fuzzy_recall_motifs_padding_and_the_probe():
    x, y = fuzzy_recall(300, 16, 64, training=False, seed=2)
    assert x.shape == y.shape == (300, 64)
    pad, keys, values_end = 15, 7, 15  # MAD: keys [0, 7), values [7, 15), pad 15
    for inputs, labels in zip(x.tolist(), y.tolist(), strict=True):
        body = inputs[next(i for i, t in enumerate(inputs) if t != pad) :]
        assert pad not in body  # padding on the left only
        asked = [t for t, lab in enumerate(labels) if lab != IGNORE]
        assert asked and all(keys <= labels[t] < values_end for t in asked)  # values only
        # labels[t] is the token after position t: the shift is right
        assert all(labels[t] == inputs[t + 1] for t in asked if t + 1 < len(inputs))
    assert (y == values_end - 1).any()  # every value id is used, the last one too
    xtr, ytr = fuzzy_recall(300, 16, 64, training=True, seed=2)
    assert torch.equal(xtr[:, 1:], ytr[:, :-1])
    # the test presents keys at the full 3 tokens: runs of key tokens are 3 long
    for tokens in x[:20].tolist():
        runs, n = [], 0
        for t in tokens:
            if t < keys:
                n += 1
            elif n:
                runs.append(n)
                n = 0
        assert set(runs + [n] if n else runs) == {3}
    with pytest.raises(ValueError, match=r"too small for motifs of 3"):
        fuzzy_recall(1, vocab_size=6)
    with pytest.raises(ValueError, match=r"motif sizes must be >= 1"):
        fuzzy_recall(1, k_motif_size=0)


def test_selective_copying_writes_the_scattered_tokens_in_order():
    x, y = selective_copying(100, 16, 64, seed=4, num_tokens_to_copy=8)
    blank, copy = 14, 15
    assert (x[:, 64 - 8 - 1] == copy).all() and (x[:, 64 - 8 :] == blank).all()
    for inputs, labels in zip(x.tolist(), y.tolist(), strict=True):
        data = [t for t in inputs[: 64 - 9] if t != blank]
        assert labels[: 64 - 8] == [IGNORE] * (64 - 8) and labels[64 - 8 :] == data
        assert inputs[64 - 10] != blank  # MAD inserts blanks only before data tokens
    with pytest.raises(ValueError, match=r"need seq_len >= 2 \* num_tokens_to_copy \+ 1 = 33"):
        selective_copying(1, seq_len=32, num_tokens_to_copy=16)


def test_compression_reconstructs_every_token():
    x, y = compression(100, 16, 32, seed=5)
    assert torch.equal(x, y) and (x[:, -1] == 15).all() and (x[:, :-1] < 15).all()


def test_memorization_uses_one_fixed_map_whatever_the_seed():
    table = memorization_map(256)
    assert len(table) == 127 and len(set(table.tolist())) == 127  # keys 0..126, distinct
    assert ((table >= 127) & (table < 255)).all()
    a, la = memorization(50, 256, 32, seed=0)
    b, lb = memorization(50, 256, 32, seed=1)
    assert not torch.equal(a, b)
    for x, y in ((a, la), (b, lb)):
        assert (x[:, 1::2] == 255).all() and (y[:, 0::2] == IGNORE).all()
        assert torch.equal(y[:, 1::2], table[x[:, 0::2]])
    assert not torch.equal(memorization_map(256, seed=1), table)


@pytest.mark.parametrize("problem", MAD_PROBLEMS)
def test_every_generator_is_deterministic_under_its_seed(problem):
    kwargs = {"seq_len": 64} if problem != "memorization" else {}
    a = GENERATORS[problem](20, seed=7, training=False, **kwargs)
    b = GENERATORS[problem](20, seed=7, training=False, **kwargs)
    c = GENERATORS[problem](20, seed=8, training=False, **kwargs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_the_data_module_refuses_what_a_problem_does_not_take():
    with pytest.raises(ValueError, match=r"unknown MAD problem 'recall'; valid ones are: in_con"):
        MADDataModule("recall")
    with pytest.raises(
        ValueError,
        match=r"MAD's compression takes no frac_noise \(it takes: no options\); "
        r"set data.frac_noise=null",
    ):
        MADDataModule("compression", frac_noise=0.2)
    with pytest.raises(ValueError, match=r"need seq_len >= 2 \* num_tokens_to_copy"):
        MADDataModule("selective_copying", block_size=16, num_tokens_to_copy=16)


def test_the_data_module_uses_training_targets_to_train_and_test_targets_to_validate():
    dm = MADDataModule("in_context_recall", block_size=32, train_examples=64, val_examples=32)
    dm.setup()
    _, y_train = dm.train_set.tensors
    _, y_val = dm.val_set.tensors
    assert not (y_train == IGNORE).any() and (y_val == IGNORE).any()
    assert dm.model_kwargs() == {"vocab_size": 16, "block_size": 31}
    assert MADDataModule("compression").model_kwargs()["bottleneck"] is True
    # memorization's 256 sequences, passed 10 times an epoch: MAD's 400 steps in 20 epochs
    memo = MADDataModule("memorization", train_examples=256, repeat=10)
    memo.setup()
    assert len(memo.train_set) == 2560 and len(memo.train_dataloader()) == 20
    assert memo.train_set.tensors[0][:256].unique(dim=0).shape[0] == 256
    assert torch.equal(memo.train_set.tensors[0][:256], memo.train_set.tensors[0][256:512])


def test_the_bottleneck_gpt_reads_every_token_back_from_the_last_state():
    torch.manual_seed(0)
    model = GPT(16, 32, n_layer=1, n_head=2, d_model=32, bottleneck=True).eval()
    x = torch.randint(15, (2, 32))
    logits = model(x)
    assert logits.shape == (2, 32, 16)
    with torch.no_grad():  # only the last position's state reaches the decoder
        h = model.norm(model.blocks[0](model.embed(x), causal=True))
        assert torch.allclose(model.lm_head(model.bottleneck(h[:, -1], 32)), logits)
    changed = x.clone()
    changed[:, 0] = (x[:, 0] + 1) % 15
    with torch.no_grad():  # the first token reaches every output through the last state
        assert (model(changed) - logits).abs().amax(-1).gt(1e-6).all()
    with pytest.raises(RuntimeError, match="reconstructs its input and does not generate"):
        model.generate(x[:, :4], 2)
    with pytest.raises(ValueError, match="decodes at most block_size=32 tokens, got 40"):
        model.bottleneck(torch.zeros(2, 32), 40)


def test_only_gpt_takes_the_compression_data(tmp_path):
    """Run in this process, as tlab-train runs it (its one line and exit code 2 for a
    ConfigError: tests/test_bad_inputs.py)."""
    from transformers_lab.config import compose_config
    from transformers_lab.errors import ConfigError
    from transformers_lab.run.fit import fit_and_test

    vit = ["experiment=mad", "data=mad_compression", "model=vit"]
    # the experiment sets a GPT's option, refused first (the preflight)
    with pytest.raises(ConfigError, match="model.tie_weights: ViT takes no tie_weights"):
        fit_and_test(compose_config("train", vit, tmp_path / "tied"))
    without = [*vit, "~model.tie_weights", "task=classification"]
    with pytest.raises(ConfigError, match="bottleneck.*use model=gpt"):
        fit_and_test(compose_config("train", without, tmp_path / "untied"))


@pytest.fixture(scope="module")
def every_task_run(tmp_path_factory) -> dict[str, dict[str, str]]:
    """One fast run of each MAD task through tlab-train, as one multirun (a process for
    all six, not one each): the summary's row of each task, by task."""
    root = tmp_path_factory.mktemp("mad")
    tasks = ",".join(f"mad_{problem}" for problem in MAD_PROBLEMS)
    proc = tlab_train(
        "-m", "experiment=mad", f"data={tasks}", "debug=fdr", "logger=csv",
        "trainer.enable_progress_bar=false", cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (root / "logs" / "debug" / "multiruns").iterdir()  # debug=fdr's task_name
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    return {r["overrides"].split("data=mad_", 1)[1].split()[0]: r for r in rows}


@pytest.mark.slow  # an end-to-end run through tlab-train (make test-slow)
@pytest.mark.parametrize("problem", MAD_PROBLEMS)
def test_every_mad_task_trains_through_tlab_train(problem, every_task_run):
    row = every_task_run[problem]
    assert row["status"] == "ok", row


@pytest.mark.slow  # over a minute on 2 cores: make test-slow
def test_a_tiny_mad_sweep_scores_each_kernel(tmp_path):
    """sweep=mad at a toy size: two tasks, two kernels, two learning rates; the summary
    keeps the best lr of each (kernel, task) and scores each kernel over the tasks."""
    proc = tlab_train(
        "sweep=mad",
        "data=mad_in_context_recall,mad_compression",
        "attention=softmax,linear",
        "optimizer.lr=1e-3,5e-4",
        "data.train_examples=64",
        "data.val_examples=32",
        "data.batch_size=32",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        "logger=csv",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = sweep_dir_of(tmp_path)
    assert "## Score: mean of `val/acc` over data" in (sweep / "summary.md").read_text()
    with (sweep / "summary.csv").open() as f:
        jobs = list(csv.DictReader(f))
    best: dict[tuple[str, str], float] = {}  # the best lr of each (kernel, task)
    for j in jobs:
        values = dict(o.split("=", 1) for o in j["overrides"].split())
        cell = (values["attention"], values["data"])
        best[cell] = max(best.get(cell, 0.0), float(j["val/acc"]))
    scores = summarize(sweep, best_over=["optimizer.lr"], mean_over=["data"])["scores"]
    for row in scores:
        kernel = row["choice"].removeprefix("attention=")
        expected = (best[kernel, "mad_in_context_recall"] + best[kernel, "mad_compression"]) / 2
        assert row["score"] == pytest.approx(expected, rel=1e-5)  # the csv has 6 digits
        assert row["cells"] == "2/2"
    assert sorted(r["choice"] for r in scores) == ["attention=linear", "attention=softmax"]


def test_generation_is_drawn_in_chunks_of_bounded_size(monkeypatch):
    """A large vocabulary or length draws fewer rows at a time; the rows are as valid."""
    import transformers_lab.data.mad as mad

    calls = []
    real = torch.randint

    def counting(*args, **kwargs):
        calls.append(args[-1])  # the size: (rows, ...)
        return real(*args, **kwargs)

    monkeypatch.setattr(mad, "CHUNK", 1000)  # 1000 numbers: 15 rows of width 64 at a time
    monkeypatch.setattr(mad.torch, "randint", counting)
    x, y = in_context_recall(50, 16, 64, training=False, seed=1)
    assert x.shape == (50, 63)
    assert max(size[0] for size in calls) == 15
    for inputs, labels in zip(x.tolist(), y.tolist(), strict=True):
        assert labels == recall_reference([*inputs, labels[-1]], 8, 16)[1:]
