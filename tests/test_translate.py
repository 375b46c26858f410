"""tlab-translate: translations of text, files and stdin, greedy and by beam search, and
its refusals, on a tiny Transformer trained for a few steps on the fake Multi30k
(tests/tiny_checkpoints.py)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from transformers_lab.config import compose_config
from transformers_lab.models import Transformer
from transformers_lab.translate import main as translate_main
from transformers_lab.translate import translate

from fake_data import PAIRS

SOURCES = [en for en, _ in PAIRS]
TARGETS = [de for _, de in PAIRS]


def translate_run(ckpt: Path, out: Path, *overrides: str) -> list[str]:
    return translate(compose_config("translate", [f"ckpt_path={ckpt}", *overrides], out))


@pytest.mark.parametrize("decode", ["decode=greedy", "decode=beam"])
def test_translate_text_prints_and_returns_one_translation_per_sentence(
    transformer_ckpt, tmp_path, capsys, decode
):
    texts = translate_run(
        transformer_ckpt, tmp_path, f"text={SOURCES}", decode, "max_new_tokens=16"
    )
    assert texts == TARGETS  # the tiny model learnt the two pairs
    out = capsys.readouterr().out
    assert out.startswith(f"run dir: {tmp_path}\n")
    assert f"{SOURCES[0]} -> {TARGETS[0]}\n" in out and f"{SOURCES[1]} -> {TARGETS[1]}\n" in out
    single = translate_run(transformer_ckpt, tmp_path / "one", f"text={SOURCES[1]}", decode)
    assert single == TARGETS[1:]


def test_translate_reads_input_file_and_stdin(transformer_ckpt, tmp_path, monkeypatch):
    sentences = [SOURCES[1], "A dog rides two horses.", SOURCES[0]]
    expected = translate_run(transformer_ckpt, tmp_path / "text", f"text={sentences}")
    assert len(expected) == 3 and expected[0] == TARGETS[1] and expected[2] == TARGETS[0]
    path = tmp_path / "sentences.txt"
    path.write_text("".join(f"{s}\n" for s in sentences))
    for size in (1, 2):
        from_file = translate_run(
            transformer_ckpt, tmp_path / f"file{size}", f"input_file={path}", f"batch_size={size}"
        )
        assert from_file == expected
    monkeypatch.setattr(
        sys, "stdin", io.StringIO(f"{sentences[0]}\n\n{sentences[1]}\n{sentences[2]}")
    )
    assert translate_run(transformer_ckpt, tmp_path / "stdin") == expected


def test_beam_search_of_one_beam_translates_as_greedy(transformer_ckpt, tmp_path, monkeypatch):
    sentences = ["A dog rides two horses.", "Two men.", "A horse, a man and dogs.", *SOURCES]
    greedy = translate_run(transformer_ckpt, tmp_path / "greedy", f"text={sentences}")
    searches = []
    search = Transformer.beam_search

    def counted(self, *args, **kwargs):
        searches.append(args)
        return search(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "beam_search", counted)
    beam = translate_run(
        transformer_ckpt, tmp_path / "beam", f"text={sentences}", "decode=beam", "beam_size=1"
    )
    assert beam == greedy and len(beam) == len(sentences)
    assert searches and searches[0][1] == 1  # beam search ran (src, beam_size=1, ...)


def test_translate_main_reads_stdin_line_by_line(transformer_ckpt, tmp_path, monkeypatch, capsys):
    """The entry point as a shell runs it, with sentences piped in."""
    argv = ["tlab-translate", f"ckpt_path={transformer_ckpt}", f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{SOURCES[0]}\n{SOURCES[1]}\n"))
    translate_main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run dir: {tmp_path / 'run'}"
    assert [line for line in lines if " -> " in line] == [f"{s} -> {t}" for s, t in PAIRS]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ckpt_path=GPT"], "tlab-translate needs an encoder-decoder Transformer checkpoint"),
        (["ckpt_path=GPT"], "trained on ShakespeareCharDataModule; tlab-sample generates text"),
        (["decode=sample"], "unknown decode=sample; valid ones are: greedy, beam"),
        (["decode=beam", "beam_size=0"], "beam_size=0: beam search keeps at least one beam"),
        (["input_file=MISSING"], "input_file MISSING does not exist"),
        (["input_file=BLANK_LINE"], "line 2 of BLANK_LINE is empty"),
        (["text=''"], "text is empty; give a sentence to translate"),
        (['text=["Two dogs.","  "]'], r"text[1] is empty"),
        (["text='§§§'"], "'§§§' encodes to no tokens"),
        (["ckpt_path=MISSING"], "no checkpoint at MISSING"),
        (["device=cuda:7"], "device must be cpu or a GPU this machine has"),
    ],
)
def test_bad_translate_input_is_one_line_and_exit_code_2(
    overrides, message, transformer_ckpt, gpt_ckpt, tmp_path, monkeypatch, capsys
):
    blank = tmp_path / "blank.txt"
    blank.write_text("Two dogs.\n\nA man.\n")
    names = {"GPT": str(gpt_ckpt), "MISSING": str(tmp_path / "missing"), "BLANK_LINE": str(blank)}

    def fill(text: str) -> str:
        for name, value in names.items():
            text = text.replace(name, value)
        return text

    args = [*map(fill, overrides), f"hydra.run.dir={tmp_path}/r"]
    if not any(arg.startswith("ckpt_path=") for arg in args):
        args.insert(0, f"ckpt_path={transformer_ckpt}")
    monkeypatch.setattr(sys, "argv", ["tlab-translate", *args])
    with pytest.raises(SystemExit) as exit_:
        translate_main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fill(message) in errors[0], err
    assert "Traceback" not in err
    if overrides == ["ckpt_path=GPT"]:
        assert "holds a GPT trained on ShakespeareCharDataModule" in errors[0]


def test_translate_without_a_checkpoint_says_to_give_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tlab-translate", "text=hi", f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_:
        translate_main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "error: ckpt_path is required: give ckpt_path=... on the command line" in err


def test_translate_takes_cpu_threads(transformer_ckpt, tmp_path):
    before = torch.get_num_threads()
    try:
        texts = translate_run(transformer_ckpt, tmp_path, f"text={SOURCES[1]}", "cpu_threads=2")
        assert texts == TARGETS[1:] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
