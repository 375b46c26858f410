"""lm-evaluation-harness on our models (``run.harness.TlabLM``), offline on tasks of the
tests' own (local JSONL files, task YAMLs in a folder given as ``include_path``): the
harness's scores are those our own scoring gives the same strings; ``tlab-eval
harness.tasks=...`` on a checkpoint writes them, and the harness's own ``HFLM`` on the
checkpoint's export (``tlab-export``) gives the same scores and the same generations;
the rolling perplexity is ``tlab-eval``'s validation loss on the same text."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from transformers_lab.config import compose_config
from transformers_lab.errors import ConfigError
from transformers_lab.models import GPT
from transformers_lab.models.scoring import loglikelihoods
from transformers_lab.run.fit import train

from fake_data import HARNESS_TASKS as TASKS
from fake_data import write_task_corpus

LOCAL = ["tlab_choice", "tlab_rolling", "tlab_until"]

ALPHA = " abcdefghijklmnopqrstuvwxyz.?"
CONTEXT = 32


def encode(text: str) -> list[int]:
    return [ALPHA.index(c) for c in text]


def decode(ids) -> str:
    return "".join(ALPHA[i] for i in ids)


def tiny_lm():
    from transformers_lab.run.harness import TlabLM

    torch.manual_seed(0)
    model = GPT(len(ALPHA), n_layer=1, n_head=2, d_model=16, block_size=CONTEXT).eval()
    return TlabLM(model, encode, decode, CONTEXT, prefix=ALPHA.index("."), batch_size=3)


def test_a_pair_is_split_as_the_harness_splits_it():
    lm = tiny_lm()
    assert lm.pair("is it ", "yes") == (encode("is it"), encode(" yes"))
    assert lm.pair("", "yes") == ([lm.prefix], encode("yes"))


def test_an_unknown_task_is_refused_with_the_nearest_names():
    from transformers_lab.run.harness import check_tasks, task_names

    manager = SimpleNamespace(all_tasks=["hellaswag", "hellaswag_de", "piqa", "lambada"])
    with pytest.raises(ConfigError, match="no task 'hellaswg' \\(the nearest: hellaswag, "):
        check_tasks(task_names("piqa,hellaswg"), manager)
    with pytest.raises(ConfigError, match="harness.tasks is empty"):
        task_names([])


def test_the_results_are_flat_metrics_each_beside_its_standard_error():
    from transformers_lab.run.harness import harness_metrics, harness_table

    results = {
        "results": {
            "gsm": {"alias": "gsm", "exact_match,strict": 0.25, "exact_match_stderr,strict": 0.1},
            "piqa": {"acc,none": 0.5, "acc_stderr,none": 0.05, "acc_norm,none": 0.6},
        }
    }
    metrics = harness_metrics(results)
    assert metrics == {
        "harness/gsm/exact_match[strict]": 0.25,
        "harness/gsm/exact_match_stderr[strict]": 0.1,
        "harness/piqa/acc": 0.5,
        "harness/piqa/acc_stderr": 0.05,
        "harness/piqa/acc_norm": 0.6,
    }
    rows = harness_table(metrics, {"piqa": ["acc"]}).splitlines()[1:]
    assert [r.split() for r in rows] == [
        ["gsm", "exact_match[strict]", "0.2500", "0.1000"],
        ["piqa", "acc", "0.5000", "0.0500"],
    ]


def test_a_task_whose_data_is_out_of_reach_is_one_line():
    from transformers_lab.run.harness import offline_refusal

    class OfflineModeIsEnabled(ConnectionError):
        pass

    said = offline_refusal(OfflineModeIsEnabled("Couldn't reach 'baber/piqa' on the Hub"))
    assert "cannot be reached (Couldn't reach 'baber/piqa' on the Hub)" in str(said)
    assert offline_refusal(ValueError("a bug")) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT (RoPE, so that it decodes past its context) trained a few steps on the
    corpus, with its char tokenizer and end-of-text token; its run dir."""
    folder = tmp_path_factory.mktemp("harness_run")
    corpus = write_task_corpus(folder)
    overrides = ["model=gpt", "model.n_layer=1", "model.d_model=16", "model.n_head=2"]
    overrides += ["model.pos_encoding=rope", "data=corpus", f"data.sources=[{corpus}]"]
    overrides += ["data.tokenizer=char", "data.block_size=16", "data.val_fraction=0.3"]
    overrides += ["data.split=tail", "data.train_samples=32", "task.sample_tokens=0"]
    overrides += ["trainer.max_steps=3", "logger=none", "test=false", "callbacks.lr_monitor=null"]
    train(compose_config("train", overrides, folder / "run"))
    return folder / "run" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def both(checkpoint, tmp_path_factory):
    """The checkpoint as our harness model, and its export as the harness's ``HFLM``."""
    from lm_eval.models.huggingface import HFLM

    from transformers_lab.export import export_checkpoint
    from transformers_lab.run.checkpoints import read_checkpoint
    from transformers_lab.run.components import restore
    from transformers_lab.run.harness import harness_model
    from transformers_lab.run.language import language_model

    folder = tmp_path_factory.mktemp("export")
    cfg = compose_config("export", [f"ckpt_path={checkpoint}", f"out={folder / 'hf'}"], folder)
    out = export_checkpoint(cfg)
    saved = read_checkpoint(str(checkpoint))
    restored = restore(saved, saved.run_config(None))
    ours = harness_model(language_model(restored, str(checkpoint), "the harness"), 2)
    hf = HFLM(pretrained=str(out), trust_remote_code=True, device="cpu", batch_size=3,
              dtype="float32")  # fmt: skip
    return ours, hf


@pytest.mark.slow  # a run, the harness's index of its tasks (7 s) and two harness runs
def test_the_harness_on_a_checkpoint_and_hflm_on_its_export_agree(checkpoint, both, tmp_path):
    from lm_eval import simple_evaluate

    from transformers_lab.eval import evaluate
    from transformers_lab.run.harness import check_tasks, run_tasks, task_manager

    harness = [f"harness.tasks=[{','.join(LOCAL)}]", f"harness.include_path={TASKS}"]
    harness += ["harness.batch_size=3", "logger=csv"]
    cfg = compose_config("eval", [f"ckpt_path={checkpoint}", *harness], tmp_path / "eval")
    ours = evaluate(cfg)
    saved = json.loads((tmp_path / "eval" / "harness.json").read_text())
    assert saved["results"]["tlab_choice"]["acc,none"] == ours["harness/tlab_choice/acc"]
    logged = (tmp_path / "eval" / "csv").rglob("metrics.csv")
    assert "harness/tlab_rolling/word_perplexity" in next(logged).read_text()

    manager = task_manager(str(TASKS))
    with pytest.raises(ConfigError, match="the nearest: lambada_openai"):
        check_tasks(["lambada_openay"], manager)  # the harness's own index
    with pytest.raises(ConfigError, match="the Hugging Face Hub cannot be reached"):
        run_tasks(tiny_lm(), OmegaConf.create({"tasks": ["piqa"]}))  # offline (conftest)
    # the multiple choice's accuracy is our own scoring of each choice
    lm, hf = both
    right, docs = 0, [json.loads(line) for line in (TASKS / "tlab_choice.jsonl").open()]
    for doc in docs:
        pairs = [lm.pair(doc["question"], " " + choice) for choice in doc["choices"]]
        values = [v for v, _ in loglikelihoods(lm.model, pairs, lm.max_length, batch_size=1)]
        right += values.index(max(values)) == doc["answer"]
    assert ours["harness/tlab_choice/acc"] == pytest.approx(right / len(docs))
    theirs = simple_evaluate(model=hf, tasks=LOCAL, task_manager=manager, bootstrap_iters=0)
    for task in LOCAL:
        for key, value in theirs["results"][task].items():
            if "," in key and isinstance(value, float) and "stderr" not in key:
                name = f"harness/{task}/{key.split(',')[0]}"
                assert ours[name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.slow
def test_our_generations_are_hflm_s_on_the_export(both):
    """Greedy generation with stops, the prompts batched and left-padded by HFLM (the
    export decodes each row on its own state): the same text."""
    ours, hf = both
    assert hf.prefix_token_id == ours.prefix  # its end of sequence: the end of text
    # HFLM keeps max_length - max_gen_toks of a prompt (10 here): prompts within that
    prompts = ["All:\n", "ROMEO:\nWh", "a", "Speak, "]
    options = {"until": ["\n\n"], "max_gen_toks": 6}
    requests = [SimpleNamespace(args=(p, options)) for p in prompts]
    texts = ours.generate_until(requests)
    assert texts == hf.generate_until(requests)
    assert len(set(texts)) > 1


@pytest.mark.slow
def test_the_rolling_perplexity_is_tlab_eval_s_validation_loss(checkpoint, tmp_path):
    """The validation split as one document read after its first token: the harness's
    rolling windows are then the validation windows, so its mean loss is val/loss."""
    from transformers_lab.eval import evaluate
    from transformers_lab.run.checkpoints import read_checkpoint
    from transformers_lab.run.components import restore
    from transformers_lab.run.harness import harness_model
    from transformers_lab.run.language import language_model

    cfg = compose_config("eval", [f"ckpt_path={checkpoint}", "logger=none"], tmp_path)
    val_loss = evaluate(cfg)["val/loss"]
    saved = read_checkpoint(str(checkpoint))
    restored = restore(saved, saved.run_config(None))
    found = language_model(restored, str(checkpoint), "the harness")
    data = restored.datamodule
    data.setup("validate")
    block = found.model.block_size
    windows = (len(data.streams["val"]) - block - 1) // block + 1
    tokens = [int(t) for t in data.streams["val"].read(0, windows * block + 1)]
    lm = harness_model(found, 4)
    lm.prefix = tokens[0]
    text = data.detokenize(tokens[1:])
    assert data.tokenize(text) == tokens[1:]
    (total,) = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))])
    assert -total / (windows * block) == pytest.approx(val_loss, rel=1e-5)
    assert math.isfinite(total)
