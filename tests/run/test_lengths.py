"""Evaluation at other lengths than the trained one (``eval_lengths``), needle depths and
the loss by position (run.lengths, tlab-eval)."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.tiny_checkpoints import QUIET, trained
from transformers_lab.analysis.positions import position_losses
from transformers_lab.config import compose_config
from transformers_lab.data.base import IGNORE
from transformers_lab.errors import ConfigError
from transformers_lab.eval import evaluate
from transformers_lab.run.checkpoints import AtomicCheckpointIO, read_checkpoint
from transformers_lab.run.components import at_length, build_datamodule, build_model
from transformers_lab.run.fit import train
from transformers_lab.run.job import run_job
from transformers_lab.run.record import read_record
from transformers_lab.train import fit_as_trial

TINY = ["model=gpt", "model.n_layer=1", "model.d_model=16", "model.n_head=2"]
TINY += ["trainer.max_steps=3", "task.sample_tokens=0"]


def evaluate_at(ckpt, tmp_path, *overrides):
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", "logger=none", *overrides], tmp_path)
    return evaluate(cfg)


def by_hand(ckpt, data_overrides, model_block_size):
    """The mean next-token loss and accuracy over the supervised tokens of the saved
    run's validation batches, the data and model built at another length here, apart from
    run.lengths: the loop the tests hold it to."""
    saved = read_checkpoint(ckpt)
    data = OmegaConf.merge(saved.config["data"], data_overrides)
    datamodule = build_datamodule(data, saved)
    model_cfg = OmegaConf.merge(saved.config["model"], {"block_size": model_block_size})
    model = build_model(model_cfg, datamodule)
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved.state_dict.items()})
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in datamodule.val_dataloader():
            logits = model(x)
            supervised = y != IGNORE
            loss_sum += float(F.cross_entropy(logits[supervised], y[supervised], reduction="sum"))
            correct += int((logits.argmax(-1)[supervised] == y[supervised]).sum())
            count += int(supervised.sum())
    return loss_sum / count, correct / count


@pytest.fixture(scope="module")
def rope_ckpt(generation_data):
    return trained(
        generation_data,
        [*TINY, "data=shakespeare_char", "data.block_size=16", "model.pos_encoding=rope"],
        "lengths_rope",
    )


@pytest.fixture(scope="module")
def mqar_ckpt(generation_data):
    mqar = ["data=mqar", "data.block_size=16", "data.num_kv_pairs=2", "data.vocab_size=32"]
    mqar += ["data.train_examples=64", "data.val_examples=40", "data.batch_size=16"]
    return trained(generation_data, [*TINY, *mqar, "model.pos_encoding=none", "task=recall"], "mq")


def test_evaluation_at_two_lengths_equals_a_loop_by_hand(rope_ckpt, tmp_path):
    metrics = evaluate_at(rope_ckpt, tmp_path, "eval_lengths=[16,48]")
    for n in (16, 48):
        loss, acc = by_hand(rope_ckpt, {"block_size": n}, n)
        assert metrics[f"val/loss@{n}"] == pytest.approx(loss, rel=1e-5)
        assert metrics[f"val/acc@{n}"] == pytest.approx(acc, abs=1e-6)
    assert metrics["val/loss@16"] != metrics["val/loss@48"]
    rows = list(csv.DictReader((tmp_path / "lengths.csv").open()))
    assert {("val/loss", "48")} <= {(r["metric"], r["length"]) for r in rows}


def test_mqar_is_scored_with_its_pairs_scaled_with_the_length(mqar_ckpt, tmp_path):
    assert at_length({"problem": "mqar", "num_kv_pairs": 2}, 16, 64) == {
        "block_size": 64,
        "num_kv_pairs": 8,
    }
    metrics = evaluate_at(mqar_ckpt, tmp_path, "eval_lengths=[32]")
    loss, acc = by_hand(mqar_ckpt, {"block_size": 32, "num_kv_pairs": 4}, 32)
    assert metrics["val/loss@32"] == pytest.approx(loss, rel=1e-5)
    assert metrics["val/acc@32"] == pytest.approx(acc, abs=1e-6)


def test_learned_positions_are_refused_past_their_table_in_one_line(gpt_ckpt, tmp_path):
    with pytest.raises(ConfigError, match=r"at length 64: its learned positions end at "):
        evaluate_at(gpt_ckpt, tmp_path, "eval_lengths=[8,64]")
    # shorter than the table runs: the model keeps its table, the data is cut
    metrics = evaluate_at(gpt_ckpt, tmp_path, "eval_lengths=[8]")
    loss, _ = by_hand(gpt_ckpt, {"block_size": 8}, 16)
    assert metrics["val/loss@8"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["eval_lengths=[0]"], "each length must be an integer >= 1; 0 is not"),
        (["eval_lengths=16"], r"eval_lengths=16 is not a list: .* eval_lengths=\[16\]"),
        (["eval_depths=[0.5]"], "eval_depths needs eval_lengths"),
        (["eval_lengths=[16]", "eval_depths=[1.5]"], r"a number in \[0, 1\] .*; 1.5 is not"),
        (["eval_lengths=[16]", "eval_depths=[0.5]"], "it is no needle task"),
        (["eval_lengths=[16]", "loss_by_position=0"], "number of buckets >= 1"),
    ],
)
def test_bad_length_options_are_refused_in_one_line(rope_ckpt, tmp_path, overrides, said):
    with pytest.raises(ConfigError, match=said):
        evaluate_at(rope_ckpt, tmp_path, *overrides)


def test_loss_by_position_sums_to_the_mean_loss(rope_ckpt, tmp_path):
    metrics = evaluate_at(rope_ckpt, tmp_path, "eval_lengths=[16,32]", "loss_by_position=4")
    rows = list(csv.DictReader((tmp_path / "loss_by_position.csv").open()))
    for n in (16, 32):
        mine = [r for r in rows if int(r["length"]) == n]
        assert [int(r["end"]) - int(r["start"]) for r in mine] == [n // 4] * 4
        tokens = sum(int(r["tokens"]) for r in mine)
        mean = sum(float(r["loss"]) * int(r["tokens"]) for r in mine) / tokens
        assert mean == pytest.approx(metrics[f"val/loss@{n}"], rel=1e-5)
    assert (tmp_path / "loss_by_position.png").stat().st_size > 0


def test_position_losses_skip_what_is_not_supervised():
    class Fixed(torch.nn.Module):
        def forward(self, x):  # the same logits everywhere: a uniform loss of log 4
            return torch.zeros(*x.shape, 4)

    class Data:
        def val_dataloader(self):
            y = torch.tensor([[1, 2, IGNORE, IGNORE]])
            return [(torch.zeros(1, 4, dtype=torch.long), y)]

    rows = position_losses(Fixed(), Data(), 2)
    assert rows[0]["loss"] == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert rows[0]["tokens"] == 2
    assert rows[1]["loss"] is None and rows[1]["tokens"] == 0


def test_a_training_run_scores_its_best_checkpoint_at_the_lengths(generation_data, tmp_path):

    rope = [*TINY, "data=shakespeare_char", "data.block_size=16", "model.pos_encoding=rope"]
    metrics = train(compose_config("train", [*QUIET, *rope, "eval_lengths=[16,32]"], tmp_path))
    assert {"val/loss@16", "val/acc@32"} <= set(metrics)
    rows = list(csv.DictReader((tmp_path / "lengths.csv").open()))
    assert len(rows) == 8  # loss, acc, ppl, bpt at two lengths


def test_a_resumed_run_reads_its_checkpoint_once_beside_lightnings_restore(
    rope_ckpt, tmp_path, monkeypatch
):
    """The job reads the checkpoint it resumes once, and resume, its wall time and
    metrics set aside share it; Lightning restores from it once more; the best checkpoint
    of the resumed run is read once for all four lengths."""
    reads, lightning = Counter(), Counter()
    load, restore = torch.load, AtomicCheckpointIO.load_checkpoint

    def counted(path, *args, **kwargs):
        reads[Path(path).resolve()] += 1
        return load(path, *args, **kwargs)

    def lightnings(io, path, *args, **kwargs):
        lightning[Path(path).resolve()] += 1
        return restore(io, path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    monkeypatch.setattr(AtomicCheckpointIO, "load_checkpoint", lightnings)
    rope = [*TINY, "data=shakespeare_char", "data.block_size=16", "model.pos_encoding=rope"]
    more = ["trainer.max_steps=5", f"ckpt_path={rope_ckpt}", "eval_lengths=[8,16,24,32]"]
    run_job(compose_config("train", [*QUIET, *rope, *more], tmp_path), fit_as_trial)
    record = read_record(tmp_path)
    assert record.status == "ok" and "val/loss@32" in record.metrics, record.error
    resumed, best = Path(rope_ckpt).resolve(), Path(record.checkpoints["best"]).resolve()
    assert lightning == Counter({resumed: 1})
    assert reads == Counter({resumed: 2, best: 1})


def test_a_training_run_refuses_a_length_before_it_trains(generation_data, tmp_path):

    learned = [*TINY, "data=shakespeare_char", "data.block_size=16", "eval_lengths=[16,64]"]
    with pytest.raises(ConfigError, match="at length 64: its learned positions end at"):
        train(compose_config("train", [*QUIET, *learned], tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_the_preset_runs_every_contender_at_1_to_8_times_its_length(tmp_path):
    """sweep=length_generalisation: each conf/extrapolation/ option, the lengths as
    multiples of the trained one (the ``multiples`` resolver), whatever the task's length."""
    from transformers_lab.config import CONF_DIR

    names = sorted(p.stem for p in (CONF_DIR / "extrapolation").glob("*.yaml"))
    cfg = compose_config("train", ["sweep=length_generalisation"], tmp_path)
    swept = cfg.hydra.sweeper.params.extrapolation.split(",")
    assert sorted(swept) == names and len(names) == 8
    assert list(cfg.eval_lengths) == [128, 256, 512, 1024]
    shorter = compose_config(
        "train", ["sweep=length_generalisation", "data.block_size=160"], tmp_path
    )
    assert list(shorter.eval_lengths) == [160, 320, 640, 1280]
    expected = {
        "softmax_rope": ("SoftmaxAttention", "rope"),
        "softmax_alibi": ("SoftmaxAttention", "alibi"),
        "sliding_window": ("SlidingWindowAttention", "rope"),
        "fastmax_p2": ("FastmaxAttention", "none"),
        "based": ("BasedAttention", "none"),
        "gla": ("GLAAttention", "none"),
        "deltanet": ("DeltaNetAttention", "none"),
        "gated_deltanet": ("GatedDeltaNetAttention", "none"),
    }
    for name in names:
        one = compose_config("train", ["experiment=needles", f"extrapolation={name}"], tmp_path)
        found = (one.attention._target_.rsplit(".", 1)[-1], one.model.pos_encoding)
        assert found == expected[name], name
        if one.model.pos_encoding == "none":  # order from a short convolution instead
            assert one.attention.short_conv == 4, name


@pytest.fixture(scope="module")
def passkey_ckpt(generation_data):
    passkey = ["data=passkey", "data.block_size=128", "data.train_examples=16"]
    passkey += ["data.val_examples=8", "data.batch_size=8", "model.pos_encoding=rope"]
    return trained(generation_data, [*TINY, *passkey, "task=recall"], "passkey")


def test_needles_are_scored_at_each_depth_of_each_length(passkey_ckpt, tmp_path):
    metrics = evaluate_at(passkey_ckpt, tmp_path, "eval_lengths=[128,256]", "eval_depths=[0,1]")
    assert {f"val/acc@{n}:d{d}" for n in (128, 256) for d in (0, 1)} <= set(metrics)
    loss, acc = by_hand(passkey_ckpt, {"block_size": 256, "depth": 1.0}, 256)
    assert metrics["val/loss@256:d1"] == pytest.approx(loss, rel=1e-5)
    assert metrics["val/acc@256:d1"] == pytest.approx(acc, abs=1e-6)
    assert metrics["val/loss@256:d1"] != metrics["val/loss@256:d0"]  # another haystack
    rows = list(csv.DictReader((tmp_path / "lengths.csv").open()))
    (row,) = [r for r in rows if (r["metric"], r["length"], r["depth"]) == ("val/acc", "256", "0")]
    assert float(row["value"]) == pytest.approx(metrics["val/acc@256:d0"], rel=1e-5)
