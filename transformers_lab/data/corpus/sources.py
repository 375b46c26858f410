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
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers_lab.data.download import ensure_file, file_digest
from transformers_lab.errors import ConfigError, DataFileError

FORMATS = {".txt": "txt", ".text": "txt", ".md": "txt", ".jsonl": "jsonl", ".json": "json"}
FORMATS |= {".parquet": "parquet"}
DOCUMENTS = ("file", "paragraphs")  # a text file is one document, or one a blank-line block
PARAGRAPH_BREAK = re.compile(r"\n[ \t\r]*\n")
PARAGRAPH_BREAK_BYTES = re.compile(rb"\n[ \t\r]*\n")
# a line break between text and text: a cut here keeps GPT-2-style pre-tokenization's pieces
LINE_WITH_TEXT = re.compile(rb"(?<=\S)\n(?=\S)")
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
    if isinstance(sources, str | os.PathLike | Mapping):
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
    spec = dict(source) if isinstance(source, Mapping) else {"path": str(source)}
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
        if not spec.get("sha256"):
            raise ConfigError(
                f"data.sources: {path} has a url but no sha256; give the file's sha256 so the "
                "download can be checked"
            )
        ensure_file(Path(expanded), spec["url"], spec["sha256"], download=download)
    if spec.get("format") and spec["format"] not in FORMATS.values():
        raise ConfigError(
            f"data.sources: unknown format {spec['format']!r} for {path}; one of "
            f"{sorted(set(FORMATS.values()))}, or hf: for a Hugging Face data set"
        )
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
    """What tells a source apart from an edited copy: its size and modification time (of a
    saved data set: its files' total and latest), and its sha256 (of a data set by name:
    its cache fingerprint)."""
    if file.format == "hf" and not Path(file.path).is_dir():
        return {"sha256": open_dataset(file)._fingerprint}
    return {**stat_of(file), "sha256": content_digest(file)}


def stat_of(file: SourceFile) -> dict[str, int]:
    paths = sorted(p for p in Path(file.path).rglob("*") if p.is_file())
    stats = [os.stat(p) for p in paths] if Path(file.path).is_dir() else [os.stat(file.path)]
    return {"size": sum(s.st_size for s in stats), "mtime_ns": max(s.st_mtime_ns for s in stats)}


def content_digest(file: SourceFile) -> str:
    if not Path(file.path).is_dir():
        return file_digest(Path(file.path))
    digest = hashlib.sha256()
    for p in sorted(Path(file.path).rglob("*")):
        if p.is_file():
            digest.update(f"{p.relative_to(file.path)}:{file_digest(p)}\n".encode())
    return digest.hexdigest()


def unchanged(file: SourceFile, recorded: dict[str, Any]) -> dict[str, Any] | None:
    """``file``'s record if it still holds what ``recorded`` (its ``fingerprint`` then)
    says, else None: the same size and time; or failing those, the same sha256 (the record
    then given the new size and time, so that the next look is a stat again)."""
    if "size" in recorded:
        now = stat_of(file)
        if now == {"size": recorded["size"], "mtime_ns": recorded["mtime_ns"]}:
            return recorded
        return {**recorded, **now} if content_digest(file) == recorded["sha256"] else None
    return recorded if fingerprint(file)["sha256"] == recorded.get("sha256") else None


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
        meta = _parquet(file).metadata
        groups = meta.num_row_groups
        group_bytes = meta.row_group(0).total_byte_size if groups else 1
        step = max(1, int(chunk_bytes // max(1, group_bytes)))
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
    """The first cut about ``at`` (from two bytes before it) that splits no document: the
    end of a line (JSON lines), of a blank line (paragraphs), or a line break between text
    and text (a text read whole)."""
    if at >= size:
        return size
    pattern = {"jsonl": re.compile(rb"\n"), "txt": LINE_WITH_TEXT}[file.format]
    if file.format == "txt" and file.documents == "paragraphs":
        pattern = PARAGRAPH_BREAK_BYTES
    base, carry = at - 2, b""  # the window starts at ``base``
    f.seek(base)
    while block := f.read(1 << 16):
        window = carry + block
        found = pattern.search(window)
        if found:
            return base + found.end()
        carry = window[-8:]
        base += len(window) - len(carry)
    return size


def _parquet(file: SourceFile) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file.path)
    except Exception as exc:
        raise DataFileError(f"data.sources: {file.path} is not a Parquet file ({exc})") from None


def read_task(file: SourceFile, task: Task) -> Iterator[tuple[tuple[int, ...], str]]:
    """The documents of ``task``, each with a key that is where it lies in its file (the
    byte it starts at, or its row): what the seeded split hashes, the same whatever the
    cutting into tasks. A text file read as one document gives each piece its start's key."""
    if file.format == "txt" and file.documents == "file":
        yield (task.file, 0), _decode(_read_bytes(file, task), file, task.start)
    elif file.format in ("txt", "jsonl"):
        data, at = _read_bytes(file, task), 0
        breaks = PARAGRAPH_BREAK_BYTES if file.format == "txt" else re.compile(rb"\n")
        for i, found in enumerate([*breaks.finditer(data), None]):
            end = found.start() if found else len(data)
            piece, key = data[at:end], (task.file, task.start + at)
            if piece.strip() and file.format == "txt":  # a block of lines, without the
                yield key, _decode(piece, file, task.start + at).strip("\r\n")  # breaks
            elif piece.strip():
                line = _decode(piece, file, task.start + at)
                yield key, _field(_json(line, file, task, i), file, task, i)
            at = found.end() if found else len(data)
    elif file.format == "json":
        for i, item in enumerate(_json_array(file)):
            yield (task.file, i), _field(item, file, task, i)
    elif file.format == "parquet":
        parquet = _parquet(file)
        first = sum(parquet.metadata.row_group(g).num_rows for g in range(task.start))
        for i, text in enumerate(_parquet_column(parquet, file, task)):
            yield (task.file, first + i), _text(text, file, f"row {first + i}")
    else:
        rows = open_dataset(file).select_columns([file.field])[task.start : task.end][file.field]
        for i, text in enumerate(rows):
            yield (task.file, task.start + i), _text(text, file, f"row {task.start + i}")


def _read_bytes(file: SourceFile, task: Task) -> bytes:
    with open(file.path, "rb") as f:
        f.seek(task.start)
        return f.read(task.size)


def _decode(data: bytes, file: SourceFile, at: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataFileError(
            f"data.sources: {file.path} is not UTF-8 text (byte {at + exc.start}); "
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
        try:
            if not head.startswith("["):  # JSON lines named .json
                return [json.loads(line) for line in f if line.strip()]
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise DataFileError(
                f"data.sources: {file.path} is not JSON ({exc.msg}, line {exc.lineno}); give a "
                "JSON array of objects, or one object a line"
            ) from None
        except UnicodeDecodeError:
            raise DataFileError(f"data.sources: {file.path} is not UTF-8 text") from None


def _parquet_column(parquet: Any, file: SourceFile, task: Task) -> list[Any]:
    names = parquet.schema_arrow.names
    if file.field not in names:
        raise DataFileError(
            f"data.sources: {file.path} has no column {file.field!r} (it has {names}); set "
            "data.text_field to the column that holds the text"
        )
    table = parquet.read_row_groups(range(task.start, task.end), columns=[file.field])
    return table.column(file.field).to_pylist()
