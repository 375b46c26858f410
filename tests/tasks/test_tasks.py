"""LightningModules: losses, metrics, optimizers and schedules, in short real fits."""

from __future__ import annotations

import functools
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from transformers_lab.data import DigitsDataModule, SyntheticDataModule
from transformers_lab.models import GPT, Transformer, ViT
from transformers_lab.tasks import (
    ClassificationTask,
    LanguageModelTask,
    TranslationTask,
    noam,
    warmup_cosine,
)


def trainer(**kw) -> L.Trainer:
    options = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    } | kw
    return L.Trainer(**options)


ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)


def test_language_model_task_learns_copy_and_logs_its_metrics():
    L.seed_everything(0)
    dm = SyntheticDataModule(
        "copy", vocab_size=8, block_size=12, train_examples=512, val_examples=64, batch_size=32
    )
    model = GPT(n_layer=2, n_head=2, d_model=32, **dm.model_kwargs())
    task = LanguageModelTask(model, ADAMW, sample_tokens=0)
    t = trainer(max_epochs=6)
    t.fit(task, dm)
    metrics = t.callback_metrics
    for name in ("train/loss", "val/loss", "val/acc", "val/ppl", "val/bpt"):
        assert name in metrics, name
    torch.testing.assert_close(metrics["val/ppl"], metrics["val/loss"].exp())
    torch.testing.assert_close(metrics["val/bpt"], metrics["val/loss"] / math.log(2))
    assert metrics["val/acc"] > 0.5  # copying 6 tokens from 7 symbols: chance is 1/7
    # the metrics are over the supervised tokens of the whole split
    losses, correct, total = 0.0, 0, 0
    with torch.no_grad():
        for x, y in dm.val_dataloader():
            logits = task.model(x)
            mask = y != -100
            losses += torch.nn.functional.cross_entropy(logits[mask], y[mask], reduction="sum")
            correct += (logits.argmax(-1)[mask] == y[mask]).sum().item()
            total += mask.sum().item()
    torch.testing.assert_close(metrics["val/loss"], torch.tensor(losses / total))
    torch.testing.assert_close(metrics["val/acc"], torch.tensor(correct / total))


def test_language_model_task_logs_a_text_sample():
    dm = SyntheticDataModule(
        "sort", vocab_size=6, block_size=8, train_examples=64, val_examples=16, batch_size=16
    )
    task = LanguageModelTask(
        GPT(n_layer=1, n_head=1, d_model=8, **dm.model_kwargs()),
        ADAMW,
        sample_tokens=5,
        sample_every=2,
    )
    task.detokenize = lambda ids: "".join("abcdef"[i] for i in ids)
    trainer(max_epochs=5, limit_train_batches=2, num_sanity_val_steps=1).fit(task, dm)
    # five validations, a sample at the 2nd and 4th; the sanity check generates nothing
    assert task.validations == 5 and len(task.samples) == 2
    assert all(len(sample) == 6 for sample in task.samples)  # the prompt token and 5 more
    with pytest.raises(ValueError, match="sample_every must be an integer >= 1"):
        LanguageModelTask(task.model, ADAMW, sample_every=0)


def test_classification_task_on_digits():
    L.seed_everything(0)
    dm = DigitsDataModule(batch_size=64)
    model = ViT(patch_size=4, d_model=32, n_layer=2, n_head=2, **dm.model_kwargs())
    task = ClassificationTask(model, ADAMW)
    t = trainer(max_epochs=4)
    t.fit(task, dm)
    assert t.callback_metrics["val/acc"] > 0.5  # chance is 0.1
    assert t.callback_metrics["val/acc_best"] >= t.callback_metrics["val/acc"]
    result = t.test(task, dm, verbose=False)[0]
    assert result["test/acc"] > 0.5


def test_translation_task_logs_loss_bleu_and_translations(tmp_path, monkeypatch, caplog):
    from tests.data.test_data import write_multi30k
    from transformers_lab.data import TranslationDataModule

    write_multi30k(tmp_path, monkeypatch)
    dm = TranslationDataModule(root=str(tmp_path), batch_size=3, download=False, block_size=40)
    dm.setup()
    model = Transformer(
        d_model=16, n_head=2, n_encoder_layers=1, n_decoder_layers=1, **dm.model_kwargs()
    )
    task = TranslationTask(model, ADAMW, bleu_batches=1, max_decode_len=10)
    task.detokenize = dm.detokenize
    t = trainer(max_steps=3, num_sanity_val_steps=0, limit_val_batches=1)
    caplog.set_level("INFO", logger="transformers_lab.tasks.base")
    t.fit(task, dm)
    assert {"train/loss", "val/loss", "val/bleu"} <= set(t.callback_metrics)
    assert 0 <= t.callback_metrics["val/bleu"] <= 100
    # a few translations with their sources and references go to the run's log
    (text,) = [r.getMessage() for r in caplog.records if "val/translations" in r.getMessage()]
    from fake_data import PAIRS

    assert f"source:      {PAIRS[0][0]}" in text and f"reference:   {PAIRS[0][1]}" in text
    assert text.count("translation: ") == 3
    # the test BLEU decodes every test batch unless told otherwise
    calls = []
    translate = model.translate
    model.translate = lambda *a, **k: calls.append(1) or translate(*a, **k)
    t.test(task, dm, verbose=False)
    assert len(calls) == len(dm.test_dataloader()) > 1 and "test/bleu" in t.callback_metrics
    assert any("test/translations" in r.getMessage() for r in caplog.records)
    task.test_bleu_batches, calls[:] = 0, []
    assert "test/bleu" not in t.test(task, dm, verbose=False)[0] and not calls


def test_optimizer_groups_and_schedules():
    model = GPT(23, 16, n_layer=1, n_head=2, d_model=16)
    sched = functools.partial(warmup_cosine, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    task = LanguageModelTask(model, ADAMW, sched)
    config = task.configure_optimizers()
    opt, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert config["lr_scheduler"]["interval"] == "step"
    lrs = []
    for _ in range(120):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    assert lrs[0] < lrs[5] < lrs[10] == pytest.approx(3e-3, rel=0.1)  # warm-up
    assert lrs[60] == pytest.approx(3e-3 * (0.1 + 0.9 * 0.5), rel=1e-6)  # half-way down
    assert lrs[115] == pytest.approx(3e-4)  # floor after max_steps
    opt2 = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    n = noam(opt2, d_model=512, warmup_steps=4000)
    factors = [n.lr_lambdas[0](s) for s in (0, 3999, 15999)]  # steps 1, 4000, 16000
    assert factors[1] == pytest.approx(512**-0.5 * 4000**-0.5)
    assert factors[0] < factors[1] and factors[2] == pytest.approx(factors[1] / 2)
    with pytest.raises(ValueError, match="max_steps=5 must exceed warmup_steps=10"):
        warmup_cosine(opt2, 10, 5)


def test_sampling_at_validation_does_not_change_training():
    """The sample has a generator of its own: the shuffles and the weights do not move."""

    def fit(sample_tokens: int) -> list[torch.Tensor]:
        L.seed_everything(0)
        dm = SyntheticDataModule(
            "sort", vocab_size=6, block_size=8, train_examples=64, val_examples=16, batch_size=16
        )
        model = GPT(n_layer=1, n_head=1, d_model=8, dropout=0.1, **dm.model_kwargs())
        task = LanguageModelTask(model, ADAMW, sample_tokens=sample_tokens)
        task.detokenize = lambda ids: "".join("abcdef"[i] for i in ids)
        trainer(max_epochs=3, num_sanity_val_steps=0).fit(task, dm)
        assert len(task.samples) == (3 if sample_tokens else 0)
        return [p.detach().clone() for p in model.parameters()]

    for with_samples, without in zip(fit(20), fit(0), strict=True):
        torch.testing.assert_close(with_samples, without)


def test_sparse_answers_go_through_the_output_layer_alone():
    """MQAR supervises a few positions: the loss and accuracy from their logits alone are
    the full forward's."""
    dm = SyntheticDataModule(
        "mqar", vocab_size=64, block_size=32, num_kv_pairs=4, train_examples=16, val_examples=8
    )
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    model = GPT(64, 32, n_layer=1, n_head=2, d_model=16)
    task = LanguageModelTask(model, ADAMW)
    loss, logits, targets = task.loss((x, y))
    assert logits.shape == (int((y != -100).sum()), 64)  # the answers only
    full = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, full)
    dense = (x, torch.roll(x, -1, dims=1))  # every position supervised: the full tensor
    assert task.loss(dense)[1].shape == (x.numel(), 64)


def small_lm(seed: int = 0, **task_kw) -> tuple[LanguageModelTask, SyntheticDataModule]:
    L.seed_everything(seed)
    dm = SyntheticDataModule(
        "copy", vocab_size=8, block_size=12, train_examples=160, val_examples=32, batch_size=16
    )
    model = GPT(n_layer=1, n_head=2, d_model=16, **dm.model_kwargs())
    return LanguageModelTask(model, ADAMW, sample_tokens=0, **task_kw), dm


@pytest.mark.parametrize(
    ("every", "bar", "steps", "expected"),
    [
        (4, 0, 12, [3, 7, 9, 11]),  # every 4th, the last batch of each epoch (10), the last step
        (4, 2, 12, [1, 3, 5, 7, 9, 11]),  # a bar refreshed every 2 steps: the gcd
        (1, 0, 5, [0, 1, 2, 3, 4]),
    ],
)
def test_train_loss_is_logged_on_the_steps_it_is_read(every, bar, steps, expected):
    task, dm = small_lm()
    logged, log = [], task.log

    def spy(name, *args, **kwargs):
        if name == "train/loss":
            logged.append(task.global_step)
        return log(name, *args, **kwargs)

    task.log = spy
    callbacks = []
    if bar:
        callbacks.append(L.pytorch.callbacks.TQDMProgressBar(refresh_rate=bar))
    t = trainer(
        max_steps=steps, log_every_n_steps=every, limit_val_batches=0, callbacks=callbacks,
        enable_progress_bar=bool(bar),
    )  # fmt: skip
    t.fit(task, dm)
    assert logged == expected
    assert "train/loss" in t.callback_metrics  # the last step's


def counted(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


def test_the_guard_s_gradient_norm_clips_as_lightning_does():
    """NonFiniteGuard's norm of the gradients serves the clipping (one norm a step, not
    two), and the weights come out bit for bit as with Lightning's own clipping."""
    from transformers_lab.run.callbacks.safety import NonFiniteGuard

    weights, clips = [], []
    for guard in (True, False):
        task, dm = small_lm(seed=1)
        calls = []
        task.clip_gradients = counted(task.clip_gradients, calls)
        callbacks = [NonFiniteGuard()] if guard else []
        t = trainer(max_steps=6, gradient_clip_val=0.05, limit_val_batches=0, callbacks=callbacks)
        t.fit(task, dm)
        weights.append([p.detach().clone() for p in task.parameters()])
        clips.append(len(calls))
    assert clips == [0, 6]  # with the guard, Lightning's clipping (and its norm) never ran
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b)


def test_a_batch_already_on_the_cpu_is_handed_over_as_it_is():
    """By the data module (every one of ours), so Lightning does not warn that the task
    overrides the data module's hook."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    task, dm = small_lm()
    assert not is_overridden("transfer_batch_to_device", task)
    cpu = torch.device("cpu")
    batch = (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    assert dm.transfer_batch_to_device(batch, cpu, 0) is batch
    import importlib

    from omegaconf import OmegaConf

    from transformers_lab.config import CONF_DIR
    from transformers_lab.data.base import DataModule

    for path in sorted((CONF_DIR / "data").glob("*.yaml")):  # every data set's module
        module, name = OmegaConf.load(path)._target_.rsplit(".", 1)
        assert issubclass(getattr(importlib.import_module(module), name), DataModule), path
    moved = dm.transfer_batch_to_device({"x": batch[0]}, cpu, 0)  # other shapes: Lightning's
    assert isinstance(moved, dict) and torch.equal(moved["x"], batch[0])
    task._current_fx_name = "training_step"  # a plain attribute, not a module entry
    assert task._current_fx_name == "training_step" and "_current_fx_name" in vars(task)
