"""The data of the tests' harness tasks: a JSONL file beside this one, read offline
(``custom_dataset: !function local.load`` with ``dataset_kwargs: {file: ...}``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load(file: str, **_: Any) -> Any:
    import datasets

    rows = [json.loads(line) for line in (Path(__file__).parent / file).read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
