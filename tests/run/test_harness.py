"""lm-evaluation-harness on our models (``run.harness.TlabLM``), offline on tasks of the
tests' own (local JSONL files, task YAMLs in a folder given as ``include_path``): the
harness's scores are those our own scoring gives the same strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from transformers_lab.models import GPT
from transformers_lab.models.scoring import generate_until, loglikelihoods

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


CHOICES = [
    {"question": "is the sky blue?", "choices": ["yes", "no"], "answer": 0},
    {"question": "is fire cold?", "choices": ["yes", "no"], "answer": 1},
    {"question": "a b c", "choices": ["d", "x", "cat"], "answer": 0},
    {"question": "", "choices": ["one", "two"], "answer": 1},
]
PROMPTS = ["the cat sat on", "once upon a", "to be or not"]


def write_task(folder: Path, name: str, rows: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    files = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
    (folder / f"{name}.yaml").write_text(f"task: {name}\n{files}test_split: test\n{body}")


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """The harness run once on a multiple-choice task and a generation with a stop."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("tasks")
    lm = tiny_lm()
    # the first prompt's target is what the model writes, so that one of three matches
    first = generate_until(lm.model, encode(PROMPTS[0]), ["."], decode, 8)
    targets = [first, "zzz", "zzz"]
    write_task(folder, "tlab_choice", CHOICES, (
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ndoc_to_choice: '{{choices}}'\n"
        "metric_list:\n  - metric: acc\n"
    ))  # fmt: skip
    prompts = [{"prompt": p, "target": t} for p, t in zip(PROMPTS, targets, strict=True)]
    write_task(folder, "tlab_until", prompts, (
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 8\n"
        "metric_list:\n  - metric: exact_match\n"
    ))  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:  # offline, a cache of the test's own
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(folder / "cache"))
        manager = TaskManager(include_path=str(folder))
        results = simple_evaluate(
            model=lm, tasks=["tlab_choice", "tlab_until"], task_manager=manager, num_fewshot=0
        )["results"]
    return lm, results


def test_a_pair_is_split_as_the_harness_splits_it():
    lm = tiny_lm()
    assert lm.pair("is it ", "yes") == (encode("is it"), encode(" yes"))
    assert lm.pair("", "yes") == ([lm.prefix], encode("yes"))


@pytest.mark.slow  # the harness indexes its thousands of task files first: 7 s
def test_the_harness_multiple_choice_accuracy_is_our_scoring_of_each_choice(scored):
    lm, results = scored
    right = 0
    for doc in CHOICES:
        pairs = [lm.pair(doc["question"], " " + choice) for choice in doc["choices"]]
        values = [v for v, _ in loglikelihoods(lm.model, pairs, CONTEXT, batch_size=1)]
        right += values.index(max(values)) == doc["answer"]
    assert results["tlab_choice"]["acc,none"] == pytest.approx(right / len(CHOICES))


@pytest.mark.slow
def test_the_harness_generation_stops_where_ours_does(scored):
    lm, results = scored
    assert results["tlab_until"]["exact_match,none"] == pytest.approx(1 / 3)
