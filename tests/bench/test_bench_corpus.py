"""The corpus bench at a tiny size: both parts run and print their side-by-side figures,
and the text it writes is what the preparation counts."""

import re

import pytest

from transformers_lab.bench import corpus

from fake_data import write_text_root

pytestmark = pytest.mark.slow


def test_the_corpus_bench_measures_both_sides_of_both_parts(tmp_path, monkeypatch, capsys):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 400
    root = write_text_root(tmp_path / "data", monkeypatch, text)
    argv = ["--size-mb", "1", "--workers", "2", "--rounds", "2", "--steps", "2"]
    assert corpus.main([*argv, "--workdir", str(tmp_path / "work"), "--root", str(root)]) == 0
    out = capsys.readouterr().out
    ours = re.search(r"\| ours .*? \| ([\d.]+) \| ([\d,]+) \| ([\d,]+) MB \|", out)
    theirs = re.search(r"\| tiktoken's .*? \| ([\d.]+) \| ([\d,]+) \| \|", out)
    assert ours and theirs, out
    documents = sum(
        len([d for d in p.read_text().split("\n\n") if d.strip()])
        for p in (tmp_path / "work" / "text").glob("*.txt")
    )
    tokens = int(ours.group(2).replace(",", "")), int(theirs.group(2).replace(",", ""))
    assert tokens[0] == tokens[1] + documents  # the same ids, and an end-of-text a document
    assert 0 < int(ours.group(3).replace(",", "")) < 1024
    assert re.search(r"ratio \(ours / tiktoken\): [\d.]+", out)
    assert re.search(r"shards [\d.]+ ms, in memory [\d.]+ ms, ratio [\d.]+", out)
