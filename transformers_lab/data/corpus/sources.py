"""A corpus's sources: text files, JSON lines, Parquet files and Hugging Face data sets,
found, checksummed, cut into tasks of bounded size, and read back as documents.

A source is a path, a glob or a folder (its ``.txt``, ``.jsonl``, ``.json`` and
``.parquet`` files), ``hf:<name>`` for a data set by name (where the machine reaches the
hub), or a mapping with the same ``path`` and its options. A task is a byte range of a file
cut at a line start (text, JSON lines), a run of Parquet row groups, or a run of rows of a
data set; each holds whole documents except where one document is larger than a task
(a text file read as one document), whose pieces are cut where a line starts with text.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers_lab.data.download import ensure_file, file_digest
from transformers_lab.errors import ConfigError, DataFileError

FORMATS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".json": "json"}
FORMATS |= {".parquet": "parquet"}
DOCUMENTS = ("file", "paragraphs")  # a text file is one document, or one a blank-line block
PARAGRAPH_BREAK = re.compile(r"\n[ \t\r]*\n")
LINE_WITH_TEXT = re.compile(rb"\n(?=\S)")  # a cut here keeps BPE's pieces as they were
OPTIONS = ("path", "hf", "format", "field", "documents", "split", "url", "sha256")


@dataclass(frozen=True)
class SourceFile:
    """One file (or one Hugging Face data set) of a corpus, and how to read it."""

    path: str  # absolute path, or the data set's name for format hf
    format: str  # txt, jsonl, json, parquet, hf
    field: str = "text"  # the text field of JSON, the column of Parquet and data sets
    documents: str = "file"  # txt only: file or paragraphs
    split: str = "train"  # hf only

    def identity(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Task:
    """Documents of one file: bytes (txt, jsonl), row groups (parquet) or rows (hf, json's
    items) ``[start, end)``; ``last`` says that the file's last document ends in it."""

    file: int
    start: int
    end: int
    last: bool

    @property
    def size(self) -> int:
        return self.end - self.start


def resolve_sources(
    sources: Any, field: str = "text", documents: str = "file", download: bool = True
) -> list[SourceFile]:
    """Every file that ``sources`` names, in order (a glob's matches sorted), or one line
    that says which source matched nothing."""
    if isinstance(sources, str | os.PathLike | dict):
        sources = [sources]
    if not sources:
        raise ConfigError(
            "data.sources is empty: give text files, globs or folders, JSONL or Parquet files, "
            "or hf:<name>, e.g. data.sources=[my_texts/*.txt]"
        )
    if documents not in DOCUMENTS:
        raise ConfigError(f"data.documents must be one of {DOCUMENTS}, got {documents!r}")
    files: list[SourceFile] = []
    for source in sources:
        files += _resolve_one(source, field, documents, download)
    return files


def _resolve_one(source: Any, field: str, documents: str, download: bool) -> list[SourceFile]:
    spec = dict(source) if isinstance(source, dict) else {"path": str(source)}
    unknown = set(spec) - set(OPTIONS)
    if unknown:
        raise ConfigError(
            f"data.sources: unknown option(s) {sorted(unknown)} in {spec}; a source takes "
            f"{', '.join(OPTIONS)}"
        )
    field = str(spec.get("field") or field)
    documents = str(spec.get("documents") or documents)
    if documents not in DOCUMENTS:
        raise ConfigError(f"data.sources: documents must be one of {DOCUMENTS}, got {documents!r}")
    path = str(spec.get("hf") or spec.get("path") or "")
    if spec.get("hf") or path.startswith("hf:"):
        return [SourceFile(path.removeprefix("hf:"), "hf", field, split=spec.get("split", "train"))]
    if not path:
        raise ConfigError(f"data.sources: a source needs a path (or hf: a data set), got {spec}")
    expanded = os.path.expanduser(path)
    if spec.get("url"):  # a file fetched once and verified: Tiny Shakespeare
        ensure_file(Path(expanded), spec["url"], spec["sha256"], download=download)
    if (Path(expanded) / "dataset_info.json").exists():  # a data set saved with save_to_disk
        return [SourceFile(str(Path(expanded).resolve()), "hf", field, split=spec.get("split"))]
    matches = sorted(glob.glob(expanded, recursive=True))
    paths: list[Path] = []
    for match in map(Path, matches):
        if match.is_dir():
            paths += sorted(p for p in match.rglob("*") if p.suffix in FORMATS and p.is_file())
        else:
            paths.append(match)
    if not paths:
        where = "" if os.path.isabs(expanded) else f" (relative to {os.getcwd()})"
        raise ConfigError(
            f"data.sources: {path!r} matches no file{where}; give an existing file, folder or glob"
        )
    files = []
    for p in paths:
        kind = spec.get("format") or FORMATS.get(p.suffix.lower())
        if kind is None:
            raise ConfigError(
                f"data.sources: cannot tell the format of {p} from its suffix; name it .txt, "
                ".jsonl, .json or .parquet, or give the source as {path: ..., format: txt}"
            )
        if p.stat().st_size == 0:
            raise ConfigError(f"data.sources: {p} is empty; remove it from data.sources")
        files.append(SourceFile(str(p.resolve()), str(kind), field, documents))
    return files


def fingerprint(file: SourceFile) -> dict[str, Any]:
    """What tells a source apart from an edited copy: size, modification time, sha256 (of
    a saved data set: of its files; of a data set by name: its cache fingerprint)."""
    if file.format != "hf":
        stat = os.stat(file.path)
        return {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "sha256": file_digest(Path(file.path)),
        }
    if Path(file.path).is_dir():
        digest = hashlib.sha256()
        for p in sorted(Path(file.path).rglob("*")):
            if p.is_file():
                digest.update(f"{p.relative_to(file.path)}:{file_digest(p)}\n".encode())
        return {"sha256": digest.hexdigest()}
    return {"sha256": open_dataset(file)._fingerprint}


def unchanged(file: SourceFile, recorded: dict[str, Any]) -> bool:
    """Whether ``file`` still holds what ``recorded`` (its ``fingerprint`` then) says:
    the same size and time, or failing that the same sha256."""
    if file.format != "hf":
        stat = os.stat(file.path)
        if (stat.st_size, stat.st_mtime_ns) == (recorded.get("size"), recorded.get("mtime_ns")):
            return True
    return fingerprint(file)["sha256"] == recorded.get("sha256")


@functools.lru_cache(maxsize=8)
def open_dataset(file: SourceFile) -> Any:
    """The Hugging Face data set of a source (a saved one from its folder), opened once a
    process."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "data.sources: a Hugging Face data set needs the datasets package: pip install datasets"
        ) from None
    try:
        if Path(file.path).is_dir():
            loaded = datasets.load_from_disk(file.path)
        else:
            loaded = datasets.load_dataset(file.path, split=file.split)
    except Exception as exc:  # the hub unreachable, a name that does not exist
        raise DataFileError(
            f"data.sources: cannot load the Hugging Face data set {file.path!r} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); offline, save it with "
            "save_to_disk on a machine that reaches the hub and give its folder"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        split = file.split or "train"
        if split not in loaded:
            raise ConfigError(
                f"data.sources: {file.path} has no split {split!r}; it has {sorted(loaded)}"
            )
        loaded = loaded[split]
    if file.field not in loaded.column_names:
        raise ConfigError(
            f"data.sources: the data set {file.path} has no column {file.field!r} (it has "
            f"{loaded.column_names}); set data.text_field"
        )
    return loaded


def plan_tasks(files: list[SourceFile], chunk_bytes: int) -> list[Task]:
    """The tasks of every file, in order, each about ``chunk_bytes`` of text or less."""
    tasks = []
    for i, file in enumerate(files):
        tasks += [Task(i, a, b, last) for a, b, last in _ranges(file, chunk_bytes)]
    return tasks


def _ranges(file: SourceFile, chunk_bytes: int) -> Iterator[tuple[int, int, bool]]:
    if file.format in ("txt", "jsonl"):
        size = os.path.getsize(file.path)
        with open(file.path, "rb") as f:
            start = 0
            while start < size:
                end = _next_cut(f, start + chunk_bytes, size, file)
                yield start, end, end == size
                start = end
    elif file.format == "parquet":
        groups = _parquet(file).metadata.num_row_groups
        step = max(1, int(chunk_bytes // max(1, _parquet_group_bytes(file))))
        for a in range(0, groups, step):
            yield a, min(groups, a + step), a + step >= groups
    elif file.format == "hf":
        data = open_dataset(file)
        rows = len(data)
        step = max(1, chunk_bytes // 2048)  # rows of a few kB each
        for a in range(0, rows, step):
            yield a, min(rows, a + step), a + step >= rows
    else:  # a JSON array, read whole
        yield 0, 1, True


def _next_cut(f: Any, at: int, size: int, file: SourceFile) -> int:
    """The first cut at or after ``at`` that splits no document (the end of a line; for
    paragraphs, of a blank line; a text read whole is cut before a line with text)."""
    if at >= size:
        return size
    pattern = {"jsonl": re.compile(rb"\n"), "txt": LINE_WITH_TEXT}[file.format]
    if file.format == "txt" and file.documents == "paragraphs":
        pattern = re.compile(rb"\n[ \t\r]*\n")
    carry = b""
    f.seek(at)
    while block := f.read(1 << 16):
        window = carry + block
        found = pattern.search(window)
        if found:
            return at - len(carry) + found.end()
        carry = window[-8:]
        at += len(block)
    return size


def _parquet(file: SourceFile) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file.path)
    except Exception as exc:
        raise DataFileError(f"data.sources: {file.path} is not a Parquet file ({exc})") from None


def _parquet_group_bytes(file: SourceFile) -> int:
    meta = _parquet(file).metadata
    return meta.row_group(0).total_byte_size if meta.num_row_groups else 1


def read_task(file: SourceFile, task: Task) -> Iterator[tuple[tuple[int, ...], str]]:
    """The documents of ``task``, each with a key that is the same whatever reads it (the
    file, where its task starts and its place in the task): what the seeded split hashes.
    A text file read as one document gives its piece under the key of its start."""
    if file.format == "txt":
        text = _read_text(file, task)
        if file.documents == "file":
            yield (task.file, 0), text
            return
        for i, paragraph in enumerate(PARAGRAPH_BREAK.split(text)):
            if paragraph.strip():  # a block of lines, without the line breaks around it
                yield (task.file, task.start, i), paragraph.strip("\r\n")
    elif file.format == "jsonl":
        for i, line in enumerate(_read_text(file, task).split("\n")):
            if line.strip():
                yield (task.file, task.start, i), _field(_json(line, file, task, i), file, task, i)
    elif file.format == "json":
        for i, item in enumerate(_json_array(file)):
            yield (task.file, i), _field(item, file, task, i)
    elif file.format == "parquet":
        for i, text in enumerate(_parquet_column(file, task)):
            yield (
                (task.file, task.start, i),
                _text(text, file, f"row {i} of row group {task.start}+"),
            )
    else:
        rows = open_dataset(file).select_columns([file.field])[task.start : task.end][file.field]
        for i, text in enumerate(rows):
            yield (task.file, task.start + i), _text(text, file, f"row {task.start + i}")


def _read_text(file: SourceFile, task: Task) -> str:
    with open(file.path, "rb") as f:
        f.seek(task.start)
        data = f.read(task.size)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataFileError(
            f"data.sources: {file.path} is not UTF-8 text (byte {task.start + exc.start}); "
            "convert it to UTF-8"
        ) from None


def _line_number(file: SourceFile, task: Task, i: int) -> int:
    with open(file.path, "rb") as f:
        return f.read(task.start).count(b"\n") + i + 1


def _json(line: str, file: SourceFile, task: Task, i: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataFileError(
            f"data.sources: {file.path} line {_line_number(file, task, i)} is not JSON "
            f"({exc.msg}); each line of a .jsonl file is one JSON object"
        ) from None


def _field(item: Any, file: SourceFile, task: Task, i: int) -> str:
    if not isinstance(item, dict) or file.field not in item:
        where = f"line {_line_number(file, task, i)}" if file.format == "jsonl" else f"item {i}"
        has = f" (it has {sorted(item)[:8]})" if isinstance(item, dict) else ""
        raise DataFileError(
            f"data.sources: {file.path} {where} has no field {file.field!r}{has}; set "
            "data.text_field to the field that holds the text"
        )
    return _text(item[file.field], file, f"the field {file.field!r} of item {i}")


def _text(value: Any, file: SourceFile, where: str) -> str:
    if not isinstance(value, str):
        raise DataFileError(
            f"data.sources: {file.path}: {where} is {type(value).__name__}, not text"
        )
    return value


def _json_array(file: SourceFile) -> list[Any]:
    with open(file.path, encoding="utf-8") as f:
        head = f.read(1 << 12).lstrip()
        f.seek(0)
        if not head.startswith("["):  # JSON lines named .json
            return [json.loads(line) for line in f if line.strip()]
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise DataFileError(
                f"data.sources: {file.path} is not JSON ({exc.msg}, line {exc.lineno})"
            ) from None


def _parquet_column(file: SourceFile, task: Task) -> list[Any]:
    parquet = _parquet(file)
    names = parquet.schema_arrow.names
    if file.field not in names:
        raise DataFileError(
            f"data.sources: {file.path} has no column {file.field!r} (it has {names}); set "
            "data.text_field to the column that holds the text"
        )
    table = parquet.read_row_groups(range(task.start, task.end), columns=[file.field])
    return table.column(file.field).to_pylist()
