"""An export of ``tlab-export`` (``hf.write.export``) loaded by transformers itself
(``AutoModelForCausalLM`` and ``AutoTokenizer`` with ``trust_remote_code``): its logits are
ours to 1e-5 in float32, and its greedy ``generate`` past ``block_size`` is ours token by
token, for softmax with RoPE (a sliding KV cache), fastmax p=2 and GLA (recurrent
states) and a hybrid with learned positions (re-encoded windows); its tokenizer reads and
writes text as ours does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from transformers_lab.config import compose_config, expand_hybrid
from transformers_lab.data.corpus.tokenizer import Chars, Tiktoken
from transformers_lab.errors import ConfigError
from transformers_lab.models import GPT
from transformers_lab.models.gpt import Decoder

from fake_data import tiny_ranks, write_ranks

ALPHA = "\n !',.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
BLOCK = 8
KERNELS = {
    "softmax-rope": ["attention=softmax", "model.pos_encoding=rope"],
    "fastmax-p2": ["attention=fastmax", "attention.p=2"],
    "gla": ["attention=gla"],
    "hybrid": ["attention=softmax", "model.hybrid=[gla,softmax]"],
}
SLOW = {"fastmax-p2", "gla", "hybrid"}  # the default suite keeps softmax with RoPE


def recipe(overrides: list[str], tmp: Path, vocab: int) -> dict:
    """A GPT's recipe as ``tlab-export`` writes it: the model config with its sizes."""
    tiny = ["model=gpt", "model.n_layer=2", "model.d_model=16", "model.n_head=2"]
    cfg = compose_config("train", [*tiny, *overrides], tmp)
    out = OmegaConf.to_container(expand_hybrid(cfg.model), resolve=True)
    return out | {"vocab_size": vocab, "block_size": BLOCK}


def exported(tmp: Path, name: str, overrides: list[str]):
    """Our GPT (its embedding spread out, so that the logits differ more between tokens)
    and its export as transformers loads it."""
    from transformers import AutoModelForCausalLM

    from transformers_lab.hf.model import build_gpt
    from transformers_lab.hf.write import export

    tokenizer = Chars(ALPHA)
    tokenizer.eot = False
    spec = recipe(overrides, tmp / "cfg", tokenizer.vocab_size)
    torch.manual_seed(0)
    gpt = build_gpt(spec).eval()
    with torch.no_grad():
        gpt.tok.weight.normal_(0, 1.0)
    out = export(gpt, spec, tokenizer, 0, tmp / f"export_{name}")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    return gpt, model, out


CASES = [
    pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [], id=name)
    for name in KERNELS
]


@pytest.mark.parametrize("name", CASES)
def test_the_export_reads_and_decodes_as_ours(name, tmp_path):
    gpt, model, _ = exported(tmp_path, name, KERNELS[name])
    assert isinstance(gpt, GPT) and model.gpt is not gpt
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, gpt.lm_head.out_features, (3, BLOCK), generator=g)
    with torch.no_grad():
        theirs, ours = model(ids).logits, gpt(ids)
    assert theirs.dtype == torch.float32
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    prompt = ids[:1, :5]
    ours = gpt.generate(prompt, 3 * BLOCK, temperature=0.0)
    theirs = model.generate(
        prompt,
        max_new_tokens=3 * BLOCK,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert theirs.sequences.tolist() == ours.tolist()  # past block_size, token by token
    # and each step's logits are those of our decoding of the same tokens: transformers
    # fed the state each new token once, in order
    decoder = Decoder(gpt)
    steps = [decoder.feed(prompt)[:, -1]]
    steps += [decoder.feed(ours[:, [t]])[:, -1] for t in range(5, ours.shape[1] - 1)]
    torch.testing.assert_close(torch.stack(theirs.logits), torch.stack(steps), atol=1e-5, rtol=0)
    # without the cache, as ours: the last block_size tokens read again at each step
    ours = gpt.generate(prompt, 2 * BLOCK, temperature=0.0, use_cache=False)
    theirs = model.generate(prompt, max_new_tokens=2 * BLOCK, do_sample=False, use_cache=False)
    assert theirs.tolist() == ours.tolist()


def test_padded_rows_read_and_decode_as_each_row_alone(tmp_path):
    """Left-padded prompts (HFLM's batches) decode as each prompt alone; right-padded rows
    score as alone; the end of text past the vocabulary reads as the prefix token."""
    gpt, model, _ = exported(tmp_path, "padded", KERNELS["softmax-rope"])
    short, long = [5, 6, 7], [1, 2, 3, 4, 9, 10]
    left = torch.tensor([[0, 0, 0, *short], long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    out = model.generate(left, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for row, prompt in enumerate([short, long]):
        alone = gpt.generate(torch.tensor([prompt]), 12, temperature=0.0)[0, len(prompt) :]
        assert out[row, 6:].tolist() == alone.tolist()
    right = torch.tensor([[*short, 0, 0, 0], long])
    with torch.no_grad():
        logits = model(right, attention_mask=mask.flip(-1)).logits
        torch.testing.assert_close(logits[0, :3], gpt(torch.tensor([short]))[0], atol=1e-5, rtol=0)
        logits = model(left, attention_mask=mask).logits
        torch.testing.assert_close(logits[0, 3:], gpt(torch.tensor([short]))[0], atol=1e-5, rtol=0)
        eos = model.config.tlab_end_of_text
        assert eos == gpt.lm_head.out_features  # Chars without an end of text of its own
        read = model(torch.tensor([[eos, *short]])).logits
        torch.testing.assert_close(read, gpt(torch.tensor([[0, *short]])), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="num_beams=2: this export decodes one sequence"):
        model.generate(left[1:], num_beams=2, max_new_tokens=2)


def test_the_export_s_tokenizer_is_ours(tmp_path):
    from transformers import AutoTokenizer

    from transformers_lab.hf.write import export

    ranks = write_ranks(tiny_ranks(), tmp_path / "tiny.tiktoken")
    bpe = Tiktoken("tiny", ranks.read_bytes())
    chars = Chars(ALPHA)
    for i, tokenizer in enumerate([chars, bpe]):
        gpt = GPT(tokenizer.vocab_size, n_layer=1, n_head=2, d_model=8, block_size=BLOCK)
        spec = {"_target_": "transformers_lab.models.GPT", "vocab_size": tokenizer.vocab_size}
        spec |= {"n_layer": 1, "n_head": 2, "d_model": 8, "block_size": BLOCK}
        out = export(gpt, spec, tokenizer, tokenizer.eot_id, tmp_path / f"tok{i}")
        theirs = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        for text in ["speak, speak.\n", "the  end ", "Zed?", ""]:
            assert theirs.encode(text) == tokenizer.encode(text)
            assert theirs.decode(tokenizer.encode(text)) == text
        assert theirs.eos_token_id == tokenizer.eot_id
        ended = [*tokenizer.encode("speak"), tokenizer.eot_id]
        assert theirs.decode(ended, skip_special_tokens=True) == "speak"
        assert theirs.decode(ended, skip_special_tokens=False) == "speak<|endoftext|>"
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == tokenizer.eot_id


def test_an_export_never_writes_over_files(tmp_path):
    from transformers_lab.hf.write import export

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    gpt = GPT(5, n_layer=1, n_head=1, d_model=4, block_size=4)
    spec = {"_target_": "transformers_lab.models.GPT", "vocab_size": 5, "n_layer": 1}
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export(gpt, spec, Chars("abcd"), 0, tmp_path / "full")
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # nothing left beside it


def every_setting() -> list[list[str]]:
    """Every kernel of conf/attention, every position encoding, the layer parts."""
    from transformers_lab.config import group_options

    kernels = [[f"attention={name}"] for name in group_options("attention")]
    positions = ["learned", "sinusoidal", "fourier", "alibi", "none"]
    encodings = [["attention=softmax", f"model.pos_encoding={p}"] for p in positions]
    parts = ["attention.short_conv=4", "attention.output_gate=true", "attention.qk_norm=true"]
    return [*kernels, *encodings, *[["attention=gla", part] for part in parts]]


@pytest.mark.slow  # 33 exports loaded by transformers: 40 s
def test_every_kernel_position_encoding_and_layer_part_exports(tmp_path):
    for i, overrides in enumerate(every_setting()):
        gpt, model, _ = exported(tmp_path, str(i), overrides)
        ids = torch.randint(0, gpt.lm_head.out_features, (2, BLOCK))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, gpt(ids), atol=1e-5, rtol=0)
        ours = gpt.generate(ids[:1, :3], 2 * BLOCK, temperature=0.0)
        theirs = model.generate(ids[:1, :3], max_new_tokens=2 * BLOCK, do_sample=False)
        assert theirs.tolist() == ours.tolist(), overrides
