"""tlab-sample: its streamed output (GPT.stream, TextStream), what it prints and refuses,
and the checks of the checkpoint it loads, on tiny checkpoints trained for a few steps on
the fake data (tests/tiny_checkpoints.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import transformers_lab.sample as sample_module
from tests.data.test_data import tiny_encoding
from transformers_lab.config import compose_config
from transformers_lab.data.tokenizers import CharTokenizer, TiktokenTokenizer
from transformers_lab.errors import ConfigError
from transformers_lab.models import GPT
from transformers_lab.models.common import sample_next
from transformers_lab.run.checkpoints import load_task
from transformers_lab.sample import TextStream, sample

# ------------------------------------------------------------------ GPT.stream


def tiny_gpt() -> GPT:
    return GPT(23, block_size=8, n_layer=2, n_head=2, d_model=16).eval()


@pytest.mark.parametrize("use_cache", [True, False])
def test_stream_yields_max_new_tokens_and_generate_is_built_on_it(use_cache):
    model, prompt = tiny_gpt(), torch.randint(0, 23, (2, 3))
    options = {"temperature": 0.9, "top_k": 10, "use_cache": use_cache}
    gen = torch.Generator().manual_seed(1)
    tokens = list(model.stream(prompt, 12, generator=gen, **options))
    assert len(tokens) == 12 and all(t.shape == (2,) for t in tokens)
    # past block_size (3 + 12 > 8): the window slides in both
    out = model.generate(prompt, 12, generator=torch.Generator().manual_seed(1), **options)
    assert out.shape == (2, 15) and torch.equal(out[:, :3], prompt)
    assert torch.equal(out[:, 3:], torch.stack(tokens, dim=1))
    assert list(model.stream(prompt, 0)) == [] and torch.equal(model.generate(prompt, 0), prompt)


def test_generate_samples_as_the_plain_sliding_window_loop():
    """generate's draws are those of the loop it always was: the last block_size tokens,
    full forward, ``sample_next`` with the same generator."""
    model, prompt = tiny_gpt(), torch.randint(0, 23, (2, 4))
    idx, gen = prompt, torch.Generator().manual_seed(7)
    for _ in range(10):
        next_id = sample_next(model(idx[:, -8:])[:, -1], 0.8, None, 0.9, gen)
        idx = torch.cat([idx, next_id[:, None]], dim=1)
    out = model.generate(
        prompt, 10, 0.8, top_p=0.9, use_cache=False, generator=torch.Generator().manual_seed(7)
    )
    assert torch.equal(out, idx)
    greedy = model.generate(prompt, 10, temperature=0)
    assert torch.equal(greedy, model.generate(prompt, 10, temperature=0, use_cache=False))


# ------------------------------------------------------------------ TextStream


def test_text_stream_gives_one_character_per_char_token():
    tok = CharTokenizer("abc \n")
    pieces = TextStream(tok.decode)
    assert [pieces.push(tok.encode(c)) for c in "ab c\n"] == list("ab c\n")
    assert pieces.finish() == "" and pieces.text == "ab c\n"


def test_text_stream_never_prints_a_broken_multibyte_character():
    tok = TiktokenTokenizer(tiny_encoding())  # byte-level: é, ß, 世 span several tokens
    text = "Grüße, 世界! speak"
    ids = tok.encode(text)
    assert len(ids) > len(text.encode("utf-8")) - 8  # mostly single bytes
    pieces = TextStream(tok.decode)
    out = [pieces.push([i]) for i in ids]
    assert "" in out  # the first bytes of a character were held back
    assert all("\ufffd" not in piece for piece in out)
    assert "".join(out) == text and pieces.finish() == ""
    # a sequence that stops inside a character ends as its decode does
    cut = TextStream(tok.decode)
    shown = "".join(cut.push([i]) for i in ids[: ids.index(tok.encode("世")[0]) + 1])
    assert shown == "Grüße, " and cut.finish() == "\ufffd"
    assert cut.text == tok.decode(ids[: ids.index(tok.encode("世")[0]) + 1])


# ------------------------------------------------------------------ tlab-sample stream


def sample_run(ckpt: Path, out: Path, *overrides: str) -> list[str]:
    return sample(compose_config("sample", [f"ckpt_path={ckpt}", *overrides], out))


def printed(monkeypatch) -> list[tuple[str, dict]]:
    """What ``sample`` prints: each call's text and options, printed as usual too."""
    calls = []

    def record(*args, **kwargs):
        calls.append((" ".join(map(str, args)), kwargs))
        print(*args, **kwargs)

    monkeypatch.setattr(sample_module, "print", record, raising=False)
    return calls


def without_run_dir(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if not line.startswith("run dir:"))


@pytest.mark.parametrize("use_cache", [True, False])
def test_sample_streams_each_token_and_prints_what_non_streaming_returns(
    gpt_ckpt, tmp_path, capsys, monkeypatch, use_cache
):
    options = ["prompt=Before", "num_samples=2", "max_new_tokens=20", f"use_cache={use_cache}"]
    whole = sample_run(gpt_ckpt, tmp_path / "whole", *options, "stream=false")
    whole_out = capsys.readouterr().out
    calls = printed(monkeypatch)
    streamed = sample_run(gpt_ckpt, tmp_path / "streamed", *options)  # stream: true, the default
    assert streamed == whole and len(whole) == 2 and whole[0] != whole[1]
    assert without_run_dir(capsys.readouterr().out) == without_run_dir(whole_out)
    # the prompt, then one flushed piece per token: a character each with the char tokenizer
    pieces = [text for text, kwargs in calls if kwargs.get("end") == ""]
    assert all(kwargs.get("flush") for _, kwargs in calls if kwargs.get("end") == "")
    first = pieces[: 1 + 20]
    assert first[0] == "Before" and all(len(piece) == 1 for piece in first[1:])
    assert "".join(first) == whole[0] and len(whole[0]) == len("Before") + 20


def test_sample_streams_bpe_text_with_multibyte_characters(bpe_gpt_ckpt, tmp_path, capsys):
    options = ["prompt='Grüße 世界'", "num_samples=1", "max_new_tokens=24", "temperature=1.0"]
    whole = sample_run(bpe_gpt_ckpt, tmp_path / "whole", *options, "stream=false")
    whole_out = capsys.readouterr().out
    streamed = sample_run(bpe_gpt_ckpt, tmp_path / "streamed", *options, "stream=true")
    assert streamed == whole and whole[0].startswith("Grüße 世界")
    assert without_run_dir(capsys.readouterr().out) == without_run_dir(whole_out)


def test_load_task_with_another_block_size_names_exactly_that_key(gpt_ckpt):
    """It listed every key as '... -> None' (issue 18)."""
    with pytest.raises(ConfigError) as err:
        load_task(gpt_ckpt, data={"block_size": 24})
    assert f"checkpoint {gpt_ckpt} was saved from a different model config (" in str(err.value)
    assert "(data.block_size: 16 -> 24);" in str(err.value)


def test_a_data_option_the_checkpoints_tokenizer_refuses_names_that_key(bpe_gpt_ckpt):
    """The saved tokenizer state is refused as it is loaded into the data module (another
    encoding than the model was trained with): one ConfigError naming the key."""
    with pytest.raises(ConfigError) as err:
        load_task(bpe_gpt_ckpt, data={"encoding": "gpt2"})
    said = str(err.value)
    assert "(ShakespeareBPEDataModule) refuses data.encoding='gpt2': the checkpoint " in said
    assert "trained with the tiktoken encoding 'tiny'" in said


def sample_main(ckpt: Path, out: Path, monkeypatch, capsys, *overrides: str) -> tuple[int, str]:
    argv = ["tlab-sample", f"ckpt_path={ckpt}", *overrides, f"hydra.run.dir={out}"]
    monkeypatch.setattr(sys, "argv", argv)
    code = 0
    try:
        sample_module.main()
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_a_prompt_outside_the_vocabulary_is_one_line(gpt_ckpt, tmp_path, monkeypatch, capsys):
    code, err = sample_main(gpt_ckpt, tmp_path, monkeypatch, capsys, "prompt='Before café'")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err, err
    assert errors == [
        "error: prompt='Before café' cannot be encoded: character 'é' is not in the vocabulary "
        "this tokenizer was built on; the model knows only the characters of its training "
        "text, so write the prompt with those"
    ]


def test_a_prompt_longer_than_the_context_says_the_window_slides_once(
    gpt_ckpt, tmp_path, monkeypatch, capsys
):
    """Learned positions end at block_size: past it the window is re-encoded, said once."""
    long = "prompt='" + "Before we proceed " * 2 + "'"  # 36 characters, block_size 16
    code, err = sample_main(
        gpt_ckpt, tmp_path, monkeypatch, capsys, long, "num_samples=2", "max_new_tokens=3"
    )
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert code == 0 and notes == [
        "note: 36 prompt tokens and 3 new ones pass the model's context of 16 (its learned "
        "positions end at block_size=16): past it the model sees only the last 16 tokens, "
        "re-encoded at each step"
    ]
    short = ["prompt=Before", "max_new_tokens=10"]  # 6 + 10 tokens: within the context
    _, err = sample_main(gpt_ckpt, tmp_path / "short", monkeypatch, capsys, *short)
    assert "note:" not in err


def test_a_model_whose_positions_go_on_reads_a_long_prompt_whole(
    rope_gpt_ckpt, tmp_path, monkeypatch, capsys
):
    """RoPE goes on past block_size: the prompt and what follows are read on the model's
    decoding state, with no crop and no note."""
    long = "prompt='" + "Before we proceed " * 2 + "'"
    code, err = sample_main(
        rope_gpt_ckpt, tmp_path, monkeypatch, capsys, long, "num_samples=1", "max_new_tokens=40"
    )
    assert code == 0 and "note:" not in err, err
    assert "40 tokens in" in err


def test_sample_takes_cpu_threads_and_says_its_tokens_per_second(
    gpt_ckpt, tmp_path, monkeypatch, capsys
):
    before = torch.get_num_threads()
    try:
        code, err = sample_main(
            gpt_ckpt, tmp_path, monkeypatch, capsys, "cpu_threads=2", "num_samples=2",
            "max_new_tokens=5",
        )  # fmt: skip
        assert code == 0, err  # cpu_threads was an unknown key
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    rates = [line for line in err.splitlines() if "tokens/s" in line]
    assert len(rates) == 2 and all(line.startswith("5 tokens in ") for line in rates)
