"""A checkpoint scored by lm-evaluation-harness (0.4), as the field scores language models:
``TlabLM`` is the harness's model over ours, scoring with ``models.scoring``:

- ``loglikelihood``: each (context, continuation) in batches, with whether greedy decoding
  gives the continuation;
- ``loglikelihood_rolling``: a whole document in windows of the model's context, each token
  predicted once (the harness's perplexities);
- ``generate_until``: greedy decoding on the model's own state (a KV cache or a recurrent
  state, past ``block_size`` where the model goes on), cut at the first stop sequence.

Text is split as the harness's own models split it: a context's trailing spaces go to the
continuation, and the continuation's tokens are those the whole text adds to the
context's. A text that starts with nothing before it is read after the ``prefix`` token.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM

from transformers_lab.errors import ConfigError
from transformers_lab.models.scoring import (
    generate_until,
    loglikelihoods,
    rolling_loglikelihood,
)
from transformers_lab.run.checkpoints import SavedCheckpoint
from transformers_lab.run.components import restore
from transformers_lab.run.language import LanguageModel, language_model

DEFAULT_GENERATED = 256  # the harness's max_gen_toks when a task gives none


class TlabLM(LM):
    """The harness's model over one of ours: ``model`` (ids (B, T) -> logits (B, T, V),
    with ``stream`` for generation), its tokenizer (``encode``, ``decode``), the context it
    reads (``max_length``: its ``block_size``), the token read before a text that has
    no context (``prefix``) and the token generation stops at (``stop_id``: the end of
    text, as an exported model's ``generate`` stops at its end-of-sequence token)."""

    def __init__(
        self,
        model: Any,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        max_length: int,
        prefix: int,
        batch_size: int = 16,
        stop_id: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.encode, self.decode = encode, decode
        self.max_length, self.prefix, self.batch_size = max_length, prefix, batch_size
        self.stop_id = stop_id

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """A request's (context, continuation) ids, as the harness's models split them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix], self.encode(continuation)
        whole, before = self.encode(context + continuation), self.encode(context)
        return before, whole[len(before) :]

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        pairs = [self.pair(*request.args) for request in requests]
        return loglikelihoods(self.model, pairs, self.max_length, self.batch_size)

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        return [
            rolling_loglikelihood(
                self.model,
                self.encode(request.args[0]),
                self.max_length,
                self.prefix,
                self.batch_size,
            )  # fmt: skip
            for request in requests
        ]

    def generate_until(self, requests: list[Any]) -> list[str]:
        out = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            count = int(options.get("max_gen_toks") or DEFAULT_GENERATED)
            ids = self.encode(context) or [self.prefix]
            out.append(generate_until(self.model, ids, until, self.decode, count, self.stop_id))
        return out


def harness_model(found: LanguageModel, batch_size: int = 16) -> TlabLM:
    """``TlabLM`` over a checkpoint's language model, with the tokenizer it trained with."""
    tokenizer = found.tokenizer
    return TlabLM(
        found.model,
        found.data.tokenize,
        found.data.detokenize,
        found.model.block_size,
        found.prefix,
        batch_size,
        stop_id=None if tokenizer is None else tokenizer.eot_id,
    )


def task_names(tasks: Any) -> list[str]:
    """``harness.tasks`` as a list of names: a list, or one string of names split by commas."""
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    names = [str(name).strip() for name in tasks or [] if str(name).strip()]
    if not names:
        raise ConfigError(
            "harness.tasks is empty; name lm-evaluation-harness tasks, e.g. "
            "harness.tasks=[lambada_openai,piqa], or take the field's table: harness=field"
        )
    return names


def task_manager(include_path: str | None) -> Any:
    """The harness's index of its tasks, and the task files of ``include_path`` (a folder
    of YAMLs, as its ``--include_path``); made once per folder in a process (indexing
    takes seconds)."""
    if include_path is None:
        return indexed(None)
    folder = Path(str(include_path)).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"harness.include_path={include_path} is not a folder; give the folder that "
            "holds your task YAML files"
        )
    return indexed(str(folder.resolve()))


@functools.cache
def indexed(folder: str | None) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=folder)


def check_tasks(names: list[str], manager: Any) -> None:
    """Refuse a task the harness does not know, naming the nearest it does."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f"the nearest: {', '.join(near)}" if near else "see `lm_eval ls tasks`"
            raise ConfigError(
                f"harness.tasks: lm-evaluation-harness has no task {name!r} ({hint}); a task "
                "of your own goes in a YAML file under harness.include_path"
            )


# what the Hub's client raises where it cannot be reached, by class name
OFFLINE = ("ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError")


def offline_refusal(exc: BaseException) -> ConfigError | None:
    """One line for a task whose data set is neither cached nor reachable."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if not names & set(OFFLINE):
        return None
    said = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    return ConfigError(
        f"harness.tasks: a task's data set is not on this machine and the Hugging Face Hub "
        f"cannot be reached ({said}); run it once where the network is, to fill the "
        "datasets cache (HF_HOME), or give harness.include_path: task files over local "
        "data (docs/training.md, Scoring and sharing a model)"
    )


def run_tasks(lm: Any, options: Any) -> dict[str, Any]:
    """lm-evaluation-harness's ``simple_evaluate`` of ``lm`` on ``options.tasks`` (with
    ``include_path``, ``num_fewshot``, ``limit``): its results, samples left out."""
    from lm_eval import simple_evaluate

    names = task_names(options.get("tasks"))
    manager = task_manager(options.get("include_path"))
    check_tasks(names, manager)
    limit = options.get("limit")
    try:
        results = simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=options.get("num_fewshot"),
            limit=limit,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=int(options.get("bootstrap_iters", 1000)),
            random_seed=0,
            numpy_random_seed=1234,
            torch_random_seed=1234,
            fewshot_random_seed=1234,
        )
    except Exception as exc:
        refusal = offline_refusal(exc)
        if refusal is None:
            raise
        raise refusal from None
    if not results:
        raise RuntimeError("lm-evaluation-harness returned no results")
    return results


def harness_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The harness's results as flat metrics: ``harness/<task>/<metric>`` (``acc``,
    ``acc_stderr``, ``word_perplexity``...; a filter other than ``none`` in brackets)."""
    out = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            metric, kept = key.split(",", 1)
            name = metric if kept == "none" else f"{metric}[{kept}]"
            out[f"harness/{task}/{name}"] = float(value)
    return out


def is_stderr(name: str) -> bool:
    """Whether a metric's name is a standard error's (``acc_stderr``, ``em_stderr[flex]``)."""
    return name.split("[")[0].endswith("_stderr")


def stderr_name(name: str) -> str:
    """The name of a metric's standard error: ``acc`` -> ``acc_stderr``, a filter kept."""
    metric, bracket, kept = name.partition("[")
    return f"{metric}_stderr{bracket}{kept}"


def harness_table(metrics: dict[str, float], report: dict[str, Any] | None = None) -> str:
    """The metrics as a table of task, metric, value and standard error; with ``report``
    ({task: [metrics]}, the field's preset) only the metrics the papers give."""
    rows = ["task                      metric               value      stderr"]
    for name, value in metrics.items():
        _, task, metric = name.split("/", 2)
        if is_stderr(metric):
            continue
        if report and task in report and metric not in list(report[task]):
            continue
        stderr = metrics.get(f"harness/{task}/{stderr_name(metric)}")
        shown = "" if stderr is None or math.isnan(stderr) else f"{stderr:.4f}"
        rows.append(f"{task:25} {metric:20} {value:10.4f} {shown:>10}")
    return "\n".join(rows)


def write_results(results: dict[str, Any], out: Path) -> Path:
    """The harness's results (per task, their versions, shots and configs) as
    ``harness.json`` in ``out``."""
    kept = {k: v for k, v in results.items() if k not in ("samples",)}
    path = Path(out) / "harness.json"
    path.write_text(json.dumps(kept, indent=2, default=str))
    return path


def score_checkpoint(
    checkpoint: SavedCheckpoint, ckpt_path: str, options: Any, data: Any = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """A checkpoint on the harness's tasks (``options``: ``tlab-eval``'s ``harness``
    node): its metrics (``harness_metrics``) and the harness's whole results. ``data``
    overrides the checkpoint's data config (``+data.root=...``)."""
    device = check_device(str(options.get("device") or "cpu"))
    restored = restore(checkpoint, checkpoint.run_config(data))
    found = language_model(restored, ckpt_path, "the harness")
    found.model.to(device)
    results = run_tasks(harness_model(found, int(options.get("batch_size") or 16)), options)
    return harness_metrics(results), results


def check_device(device: str) -> str:
    """``harness.device`` where this machine has it, or one line that says what it has."""
    import torch

    try:
        where = torch.device(device)
    except RuntimeError:
        raise ConfigError(
            f"harness.device={device} is no device: give cpu, cuda or cuda:<n>"
        ) from None
    if where.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0 or (where.index or 0) >= count:
            raise ConfigError(
                f"harness.device={device}: this machine has {count} CUDA GPU(s); give "
                f"harness.device=cpu{' or cuda:<n> below ' + str(count) if count else ''}"
            )
    return device
