"""A corpus prepared once: its sources tokenized in parallel, with bounded memory, into
token shards (uint16, or uint32 past 65,536 ids) with a manifest.

The preparation's folder is named by a key of the sources, the tokenizer and the split, so
a second run with the same ones finds it, and a run with other ones prepares its own. In
the folder:

- ``plan.json``: the sources with their checksums, the tokenizer and the tasks, each shard
  a fixed run of tasks (written first; a run that resumes follows it);
- ``train-00000.bin``, ``val-00000.bin``: a shard's tokens, documents joined by the
  end-of-text id; ``shard-00000.json``: their token counts and checksums, written last, so
  a shard without its ``.json`` was cut short and is made again;
- ``tokenizer.json``: the tokenizer's state, from which it is rebuilt with no other file;
- ``manifest.json``: written when every shard is, what a run reads.

A source that changed after its preparation (another size or time, then another sha256)
is said in one line and the corpus is prepared again. Two processes that prepare the same
corpus at once (the ranks of a run, the jobs of a sweep) take turns on a lock: the second
finds the first's shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from transformers_lab.data.corpus.sources import (
    SourceFile,
    Task,
    fingerprint,
    plan_tasks,
    read_task,
    unchanged,
)
from transformers_lab.data.corpus.tokenizer import (
    Chars,
    CorpusTokenizer,
    json_state,
    tokenizer_from_state,
)
from transformers_lab.errors import ConfigError
from transformers_lab.files import atomic_write, file_lock, move_into_place

log = logging.getLogger(__name__)

VERSION = 2  # of the folder's layout; a new one prepares again
SPLITS = ("documents", "tail")


@dataclass(frozen=True)
class Settings:
    """How documents are split and the work is cut.

    split: ``documents``, each document to validation with probability ``val_fraction``
        (a hash of ``split_seed`` and where the document is: the same whatever the number
        of processes); or ``tail``, the last ``val_fraction`` of each document's characters
        (nanoGPT's split of Tiny Shakespeare, a corpus of one document).
    chunk_bytes: the text a task reads (a worker holds about one at a time).
    shard_bytes: the text a shard is made of (shards are whole runs of tasks).
    """

    split: str = "documents"
    val_fraction: float = 0.01
    split_seed: int = 0
    chunk_bytes: int = 4 << 20
    shard_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ConfigError(f"data.split must be one of {SPLITS}, got {self.split!r}")
        if isinstance(self.val_fraction, bool) or not 0 < self.val_fraction < 1:
            raise ConfigError(
                f"data.val_fraction must be a number in (0, 1), got {self.val_fraction!r}"
            )
        if self.chunk_bytes < 1 << 10 or self.shard_bytes < self.chunk_bytes:
            raise ConfigError(
                f"data.chunk_bytes must be >= 1024 and data.shard_bytes >= chunk_bytes, got "
                f"{self.chunk_bytes} and {self.shard_bytes}"
            )


def corpus_key(files: list[SourceFile], tokenizer: str, settings: Settings) -> str:
    """The key of a preparation: its sources (where and how they are read), the tokenizer's
    identity and the settings."""
    what = {
        "version": VERSION,
        "sources": [f.identity() for f in files],
        "tokenizer": tokenizer,
        "settings": asdict(settings),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` for the block (``files.file_lock``); on a file system
    without locks, the block runs unguarded after a warning."""
    with file_lock(path) as refused:
        if refused is not None:
            log.warning(
                "data: no file lock at %s (%s); processes that prepare this corpus at once "
                "would not take turns: prepare it first with tlab-prepare",
                path,
                refused,
            )
        yield


def prepare(
    files: list[SourceFile],
    tokenizer: CorpusTokenizer | None,
    settings: Settings,
    folder: Path,
    workers: int = 1,
    eot: bool = True,
) -> dict[str, Any]:
    """The manifest of the corpus prepared in ``folder``, preparing it first where it is
    missing, cut short, or made from sources that have changed since. ``tokenizer=None``
    builds a character tokenizer from the corpus (``eot``: with an end-of-text id)."""
    with locked(folder.with_name(folder.name + ".lock")):
        manifest = read_json(folder / "manifest.json")
        if manifest is not None:
            before = json.dumps(manifest["sources"])
            if sources_unchanged(files, manifest["sources"], folder):
                if json.dumps(manifest["sources"]) != before:  # touched, not changed
                    atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1))
                return manifest
            shutil.rmtree(folder)
        return _prepare(files, tokenizer, settings, folder, max(1, workers), eot)


def sources_unchanged(files: list[SourceFile], recorded: list[dict], folder: Path) -> bool:
    """Whether every source still holds what it held when ``folder`` was prepared (a
    changed one is said, once). ``recorded`` takes the sizes and times of sources touched
    but not changed, so that the next look is a stat again."""
    for i, (file, before) in enumerate(zip(files, recorded, strict=True)):
        now = unchanged(file, before)
        if now is None:
            log.warning(
                "data: %s changed since it was prepared into %s (sha256 %s...); preparing "
                "the corpus again",
                file.path,
                folder,
                before.get("sha256", "?")[:12],
            )
            return False
        recorded[i] = now
    return True


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file of the preparation, or None where it is missing or cut short (a file
    a crash left empty is one to write again)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _prepare(
    files: list[SourceFile],
    tokenizer: CorpusTokenizer | None,
    settings: Settings,
    folder: Path,
    workers: int,
    eot: bool,
) -> dict[str, Any]:
    start = time.perf_counter()
    plan = read_json(folder / "plan.json")
    if plan is not None and not sources_unchanged(files, plan["sources"], folder):
        plan = None
    if plan is None:  # a fresh start: nothing of an older plan is kept
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        plan = make_plan(files, tokenizer, settings, workers, eot)
        state = json.dumps(plan["tokenizer"])
        atomic_write(folder / "tokenizer.json", state, sync=True)  # before the plan that needs it
        atomic_write(folder / "plan.json", json.dumps(plan), sync=True)
    else:
        log.info("data: resuming the preparation in %s", folder)
    tokenizer = tokenizer_from_state(plan["tokenizer"])
    tasks = [Task(*t) for t in plan["tasks"]]
    dtype = token_dtype(tokenizer.vocab_size)
    shards = []
    todo = []
    for i, (a, b) in enumerate(plan["shards"]):
        done = read_json(folder / f"shard-{i:05d}.json")
        if done is not None and shard_files_whole(folder, done, dtype):
            shards.append(done)
        else:
            todo.append((i, a, b))
    context = (files, plan["tokenizer"], settings, np.dtype(dtype).name)
    results = run_tasks(
        [t for _, a, b in todo for t in tasks[a:b]], context, workers, progress=len(tasks)
    )
    for i, a, b in todo:
        shards.append(write_shard(folder, i, (next(results) for _ in range(a, b)), dtype))
    shards.sort(key=lambda s: s["index"])
    manifest = {
        "version": VERSION,
        "sources": plan["sources"],
        "tokenizer": {
            "kind": tokenizer.kind,
            "name": tokenizer.describe(),
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "file": "tokenizer.json",
            "fingerprint": tokenizer.fingerprint(),
        },
        "dtype": np.dtype(dtype).name,
        "settings": asdict(settings),
        "documents": {  # the documents, and the parts of them each split holds
            s: sum(sh["documents"][s] for sh in shards) for s in ("train", "val", "total")
        },
        "tokens": {s: sum(sh[s]["tokens"] for sh in shards) for s in ("train", "val")},
        "shards": shards,
    }
    atomic_write(folder / "manifest.json", json.dumps(manifest, indent=1), sync=True)
    log.info(
        "data: prepared %s: %d documents, %d training and %d validation tokens (%s) in %.1f s",
        folder,
        manifest["documents"]["total"],
        manifest["tokens"]["train"],
        manifest["tokens"]["val"],
        manifest["dtype"],
        time.perf_counter() - start,
    )
    return manifest


def make_plan(
    files: list[SourceFile],
    tokenizer: CorpusTokenizer | None,
    settings: Settings,
    workers: int,
    eot: bool,
) -> dict[str, Any]:
    """The tasks, their shards, the sources' checksums and the tokenizer (a character one
    built here from every character of the corpus)."""
    tasks = plan_tasks(files, settings.chunk_bytes)
    if tokenizer is None:
        chars: set[str] = set()
        for found in run_tasks(tasks, (files, None, settings, "chars"), workers):
            chars |= found
        tokenizer = Chars(chars)
        tokenizer.eot = eot
    shards, first, size = [], 0, 0
    for i, task in enumerate(tasks):
        size += task_bytes(files[task.file], task)
        if size >= settings.shard_bytes or i == len(tasks) - 1:
            shards.append((first, i + 1))
            first, size = i + 1, 0
    return {
        "version": VERSION,
        "sources": [{**f.identity(), **fingerprint(f)} for f in files],
        "tokenizer": json_state(tokenizer.state_dict()),
        "tasks": [list(asdict(t).values()) for t in tasks],
        "shards": shards,
    }


def task_bytes(file: SourceFile, task: Task) -> int:
    """About how much text a task holds (rows and row groups counted at a few kB)."""
    return task.size if file.format in ("txt", "jsonl") else task.size * 4096


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def shard_files_whole(folder: Path, shard: dict[str, Any], dtype: type) -> bool:
    size = np.dtype(dtype).itemsize
    for split in ("train", "val"):
        path = folder / shard[split]["file"]
        if not path.exists() or path.stat().st_size != shard[split]["tokens"] * size:
            return False
    return True


def write_shard(
    folder: Path, index: int, results: Iterable[dict[str, Any]], dtype: type
) -> dict[str, Any]:
    """Shard ``index`` from its tasks' results: both splits' files through temporary files,
    then their ``.json``."""
    shard: dict[str, Any] = {"index": index, "chars": 0}
    shard["documents"] = {"train": 0, "val": 0, "total": 0}
    names = {split: f"{split}-{index:05d}.bin" for split in ("train", "val")}
    parts = {split: folder / f".{name}.part" for split, name in names.items()}
    digests = {split: hashlib.sha256() for split in names}
    counts = dict.fromkeys(names, 0)
    try:
        with ExitStack() as stack:
            outs = {split: stack.enter_context(open(p, "wb")) for split, p in parts.items()}
            for result in results:
                shard["chars"] += result["chars"]
                shard["documents"]["total"] += result["documents"]["total"]
                for split, out in outs.items():
                    data = result[split].tobytes()
                    out.write(data)
                    digests[split].update(data)
                    counts[split] += len(result[split])
                    shard["documents"][split] += result["documents"][split]
            for out in outs.values():
                out.flush()
                os.fsync(out.fileno())
        for split, name in names.items():
            move_into_place(parts[split], folder / name)
            shard[split] = {
                "file": name,
                "tokens": counts[split],
                "sha256": digests[split].hexdigest(),
            }
    finally:
        for part in parts.values():
            part.unlink(missing_ok=True)
    atomic_write(folder / f"shard-{index:05d}.json", json.dumps(shard), sync=True)
    return shard


# ----- the work of one task, in a worker process (or in this one) -----

_CONTEXT: dict[str, Any] = {}


def _start_worker(files: Any, tokenizer: Any, settings: Settings, dtype: str) -> None:
    _CONTEXT.clear()
    _CONTEXT.update(files=files, settings=settings, dtype=dtype)
    if tokenizer is not None:
        _CONTEXT["tokenizer"] = tokenizer_from_state(tokenizer)


def _start_pool_worker(*context: Any) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a process a worker, one thread each
    _start_worker(*context)


def _do_task(task: Task) -> Any:
    files, settings = _CONTEXT["files"], _CONTEXT["settings"]
    file = files[task.file]
    if _CONTEXT["dtype"] == "chars":
        found: set[str] = set()
        for _, text in read_task(file, task):
            found.update(text)
        return found
    tokenizer: CorpusTokenizer = _CONTEXT["tokenizer"]
    parts: dict[str, list[str]] = {"train": [], "val": []}
    ends: dict[str, list[bool]] = {"train": [], "val": []}
    chars, documents = 0, 0
    for key, text in read_task(file, task):
        chars += len(text)
        whole = file.format != "txt" or file.documents != "file" or task.last
        documents += whole
        for split, part, end in split_document(key, text, task, file, settings, whole):
            if part:
                parts[split].append(part)
                ends[split].append(end)
    result: dict[str, Any] = {"chars": chars, "documents": {"total": documents}}
    eot = tokenizer.eot_id
    for split in ("train", "val"):
        pieces: list[Sequence[int]] = []
        for encoded, end in zip(tokenizer.encode_batch(parts[split]), ends[split], strict=True):
            pieces.append(encoded)
            if end and eot is not None:
                pieces.append((eot,))
        count = sum(map(len, pieces))
        result[split] = np.fromiter(chain.from_iterable(pieces), _CONTEXT["dtype"], count)
        result["documents"][split] = sum(ends[split])
    return result


def split_document(
    key: tuple[int, ...], text: str, task: Task, file: SourceFile, settings: Settings, last: bool
) -> list[tuple[str, str, bool]]:
    """(split, text, ends) of one document (or of this task's piece of it, ``last`` where
    the document ends here): all of it to the split its key hashes to; or, split by
    ``tail``, its head to training and its tail to validation (a text file larger than a
    task cut by bytes, each task's piece on its side of the cut). ``ends``: the part ends
    in its split, with an end-of-text token (a head ends where its tail begins)."""
    if settings.split == "documents":
        digest = hashlib.blake2b(repr((settings.split_seed, *key)).encode(), digest_size=8)
        to_val = int.from_bytes(digest.digest(), "big") < settings.val_fraction * 2**64
        return [("val" if to_val else "train", text, last)]
    if file.format == "txt" and file.documents == "file" and not (task.start == 0 and task.last):
        cut_byte = int(os.path.getsize(file.path) * (1 - settings.val_fraction))
        if task.end <= cut_byte:
            return [("train", text, task.end == cut_byte)]
        if task.start >= cut_byte:
            return [("val", text, last)]
        cut = len(text.encode("utf-8")[: cut_byte - task.start].decode("utf-8", "ignore"))
    else:
        cut = int(len(text) * (1 - settings.val_fraction))  # on characters, as nanoGPT
    return [("train", text[:cut], True), ("val", text[cut:], last)]


def run_tasks(
    tasks: list[Task], context: tuple, workers: int, progress: int | None = None
) -> Iterator[Any]:
    """``_do_task`` of each task, in order, on ``workers`` processes with at most two tasks
    a worker in flight (the source is read as the results are written, never ahead)."""
    bar = None
    if progress:
        from tqdm import tqdm

        done = progress - len(tasks)
        bar = tqdm(total=progress, initial=done, desc="preparing", unit="task", disable=None)
    try:
        if workers <= 1 or len(tasks) <= 1:
            _start_worker(*context)
            for task in tasks:
                yield _do_task(task)
                if bar is not None:
                    bar.update()
            return
        pool = ProcessPoolExecutor(
            workers, multiprocessing.get_context("fork"), _start_pool_worker, context
        )
        try:
            yield from _in_order(pool.submit, _do_task, tasks, 2 * workers, bar)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if bar is not None:
            bar.close()


def _in_order(
    submit: Callable, fn: Callable, items: list[Any], window: int, bar: Any
) -> Iterator[Any]:
    pending: deque = deque()
    upcoming = iter(items)
    for item in upcoming:
        pending.append(submit(fn, item))
        if len(pending) >= window:
            break
    while pending:
        result = pending.popleft().result()
        for item in upcoming:
            pending.append(submit(fn, item))
            break
        if bar is not None:
            bar.update()
        yield result


def load_tokenizer(folder: Path) -> CorpusTokenizer:
    """The tokenizer a prepared corpus was made with, from its ``tokenizer.json``."""
    return tokenizer_from_state(json.loads((folder / "tokenizer.json").read_text()))
