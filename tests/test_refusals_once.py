"""Each refusal of the bad-input table is written once in the code: a rule has one owner.

Every string literal of ``transformers_lab`` is read (an f-string as its literal parts).
For each message of ``test_bad_inputs.CASES`` the longest literal phrase (20 characters or
more) it contains is its anchor, and that anchor must be written in exactly one place. Two
places are two owners of one rule (an early check repeating a constructor's refusal), which
drift apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_bad_inputs import CASES

PACKAGE = Path(__file__).resolve().parents[1] / "transformers_lab"
SHORTEST = 20  # a literal part shorter than this may be glue ("must be an integer >= ")


def literal_parts() -> list[tuple[str, str]]:
    """(the text, where) of every string literal and f-string part of the package."""
    parts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                pieces = [v.value for v in node.values if isinstance(v, ast.Constant)]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in docstrings:
                    continue
                pieces = [node.value]
            else:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
            parts += [
                (p.strip(), where)
                for p in pieces
                if len(p.strip()) >= SHORTEST and " " in p.strip()  # a phrase, not a key
            ]
    return parts


def anchor(message: str, parts: list[tuple[str, str]]) -> str | None:
    """The longest literal part of the code that the message contains, or the message
    itself where a literal contains it (the table quotes part of a line)."""
    if len(message) >= SHORTEST and any(message in text for text, _ in parts):
        return message
    inside = [text for text, _ in parts if text in message]
    return max(inside, key=len, default=None)


def test_each_refusal_of_the_bad_input_table_is_written_once():
    parts = literal_parts()
    messages = [param.values[2] for param in CASES]
    anchored, twice = 0, []
    for message in messages:
        text = anchor(message, parts)
        if text is None:  # the whole message is another library's (an exception's text)
            continue
        anchored += 1
        places = sorted({where for t, where in parts if text in t})
        if len(places) > 1:
            twice.append(f"{text!r} in {', '.join(places)}")
    # the rest are made of short glue around values, or are another library's text
    assert anchored >= 40, f"only {anchored} of {len(messages)} messages found in the code"
    assert not twice, "a refusal written in more than one place:\n" + "\n".join(twice)


def test_the_scan_finds_a_refusal_written_twice(tmp_path, monkeypatch):
    """The scan itself: a second copy of a message in another module is caught."""
    copy = tmp_path / "transformers_lab"
    copy.mkdir()
    (copy / "a.py").write_text('raise ValueError(f"{x} weighs positions up to its max_len={n}")\n')
    (copy / "b.py").write_text('MSG = "weighs positions up to its max_len="\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", copy)
    parts = literal_parts()
    text = anchor("cosformer weighs positions up to its max_len=64, but ...", parts)
    assert text == "weighs positions up to its max_len="
    assert len({where for t, where in parts if text in t}) == 2
