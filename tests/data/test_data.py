"""Data: downloads, tokenizers, windows, data modules on small files the tests write,
and the real data sets when TLAB_DATA_DIR holds them."""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from transformers_lab.data import (
    CharTokenizer,
    DigitsDataModule,
    FashionMNISTDataModule,
    MNISTDataModule,
    ShakespeareBPEDataModule,
    ShakespeareCharDataModule,
    SyntheticDataModule,
    TiktokenTokenizer,
    TranslationDataModule,
    WordTokenizer,
    copy_or_sort,
    download,
    ensure_file,
    load_encoding,
    mqar,
)
from transformers_lab.data import translation as translation_module
from transformers_lab.data.corpus.windows import TokenStream, TokenWindows
from transformers_lab.data.tokenizers import GPT2_PATTERN, split_pieces
from transformers_lab.data.translation import BucketBatchSampler, read_iwslt_train, read_iwslt_xml
from transformers_lab.errors import DataFileError

from fake_data import (
    PAIRS,
    TEXT,
    sha256,
    tiny_ranks,
    write_idx,
    write_multi30k,
    write_ranks,
    write_text_root,
)

CONF = Path(__file__).resolve().parents[2] / "conf"
REAL = Path(os.environ.get("TLAB_DATA_DIR", "/nonexistent"))


# ---------------------------------------------------------------- downloads


def test_download_is_verified_and_atomic(tmp_path, monkeypatch):
    payload = b"hello data"
    good = hashlib.sha256(payload).hexdigest()
    target = tmp_path / "sub" / "file.bin"

    def fetch(url, path, timeout=60.0):
        Path(path).write_bytes(payload)

    monkeypatch.setattr(download, "fetch", fetch)
    assert ensure_file(target, "https://example.org/file.bin", good) == target
    assert target.read_bytes() == payload
    assert [p.name for p in target.parent.iterdir()] == ["file.bin"]  # no temp file left
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600
    # an existing good file is not fetched again
    monkeypatch.setattr(download, "fetch", lambda *a, **k: pytest.fail("fetched again"))
    ensure_file(target, "https://example.org/file.bin", good)


def test_corrupted_download_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "fetch", lambda url, path, timeout=60.0: path.write_bytes(b"x"))
    target = tmp_path / "file.bin"
    with pytest.raises(DataFileError, match="fails its checksum.*nothing was written"):
        ensure_file(target, "https://example.org/file.bin", "0" * 64)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError("connection reset by peer"),
        http.client.IncompleteRead(b"half of it", 10),  # a transfer cut short
        ValueError("unknown url type: 'htp'"),  # a malformed URL
    ],
    ids=["reset", "incomplete", "bad-url"],
)
def test_interrupted_download_leaves_no_partial_file(tmp_path, monkeypatch, error):
    def fetch(url, path, timeout=60.0):
        Path(path).write_bytes(b"half of it")
        raise error

    monkeypatch.setattr(download, "fetch", fetch)
    target = tmp_path / "file.bin"
    with pytest.raises(DataFileError) as info:
        ensure_file(target, "https://example.org/file.bin", "0" * 64)
    message = str(info.value)
    assert "https://example.org/file.bin" in message and str(target) in message
    assert list(tmp_path.iterdir()) == []


def test_offline_missing_file_names_url_and_path(tmp_path, monkeypatch):
    import urllib.error

    def fetch(url, path, timeout=60.0):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(download, "fetch", fetch)
    dm = ShakespeareCharDataModule(root=str(tmp_path))
    with pytest.raises(DataFileError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert ShakespeareCharDataModule.url in message
    assert str(tmp_path / "shakespeare" / "input.txt") in message
    with pytest.raises(DataFileError, match="downloads are off"):
        ShakespeareCharDataModule(root=str(tmp_path), download=False).prepare_data()


def test_existing_corrupted_file_fails_its_checksum(tmp_path):
    path = tmp_path / "shakespeare" / "input.txt"
    path.parent.mkdir()
    path.write_text("not shakespeare")
    with pytest.raises(DataFileError, match="fails its checksum.*delete it"):
        ShakespeareCharDataModule(root=str(tmp_path)).prepare_data()


def test_md5_checksums(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    ensure_file(path, "https://example.org/f", "md5:" + hashlib.md5(b"abc").hexdigest())
    with pytest.raises(DataFileError, match="md5"):
        ensure_file(path, "https://example.org/f", "md5:" + "0" * 32)


# ---------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trip_and_specials(tmp_path):
    tok = CharTokenizer.from_text(TEXT)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.vocab_size == len(set(TEXT))
    tok.save(tmp_path / "vocab.json")
    assert CharTokenizer.load(tmp_path / "vocab.json").itos == tok.itos
    special = CharTokenizer.from_text(TEXT, specials=True)
    assert [special.special_id(s) for s in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    ids = [special.special_id("<bos>"), *special.encode("Speak"), special.special_id("<eos>")]
    assert special.decode(ids) == "Speak"
    with pytest.raises(ValueError, match="'#' is not in the vocabulary"):
        tok.encode("#")
    # ids are the sorted characters' places, for any code point, and one past the largest
    # known (the lookup table's end) is refused as well as one inside it
    wide = CharTokenizer.from_text("zé😀a")
    assert wide.encode("a😀éz") == [0, 3, 2, 1] and wide.encode("") == []
    assert wide.encode("a😀") == [wide.stoi[c] for c in "a😀"]
    for bad in ("\U0001f601", "b", "\udcff"):  # a lone surrogate, as argv can hold
        with pytest.raises(ValueError, match=re.escape(f"{bad!r} is not in the vocabulary")):
            wide.encode("a" + bad)


@pytest.mark.parametrize(
    "text",
    [TEXT, "  two  spaces\tand a tab\n", "snake_case x2 ² 3.5%, «quotes» naïve Straße!", ""],
)
def test_pieces_cover_every_character(text):
    assert "".join(split_pieces(text)) == text


def test_word_tokenizer_keeps_frequent_words_and_spells_out_the_rest():
    texts = ["A man rides a horse.", "A man walks.", "The man rides."]
    tok = WordTokenizer.from_texts(texts, min_freq=2, specials=True)
    words = {tok.itos[i] for i in tok.encode("A man rides.")}
    assert {"A", " man", " rides", "."} <= words  # each seen twice or more: one token each
    assert " horse" not in tok.stoi and " walks" not in tok.stoi  # seen once
    assert len(tok.encode(" horse")) == len(" horse")  # spelled out in characters
    for text in ["A horse rides a man.", "The horse. A man walks"]:
        assert tok.decode(tok.encode(text)) == text  # no <unk>: nothing is lost
    ids = [tok.special_id("<bos>"), *tok.encode("A man"), tok.special_id("<eos>")]
    assert tok.decode(ids) == "A man"
    with pytest.raises(ValueError, match="'#' is not in the vocabulary"):
        tok.encode("A #")
    with pytest.raises(ValueError, match="min_freq must be >= 1"):
        WordTokenizer.from_texts(texts, min_freq=0)
    meta = tok.state_dict()
    restored = WordTokenizer(meta["words"], meta["chars"], specials=True)
    assert restored.itos == tok.itos and meta["kind"] == "word"


def tiny_encoding() -> tiktoken.Encoding:
    """A tiktoken Encoding built from local ranks (no download)."""
    return tiktoken.Encoding(
        "tiny", pat_str=GPT2_PATTERN, mergeable_ranks=tiny_ranks(), special_tokens={}
    )


def test_tiktoken_tokenizer_round_trip_and_specials(tmp_path):
    tok = TiktokenTokenizer(tiny_encoding(), specials=True)
    text = TEXT.lower()
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("speak")) == 1  # merges apply
    assert tok.vocab_size == tok.encoding.n_vocab + 3
    assert tok.special_id("<pad>") == tok.encoding.n_vocab
    assert (
        tok.decode([tok.special_id("<bos>"), *tok.encode("the"), tok.special_id("<eos>")]) == "the"
    )
    # the same ranks from a local .tiktoken file
    write_ranks(tiny_ranks(), tmp_path / "tiny.tiktoken")
    local = load_encoding("tiny", tmp_path / "tiny.tiktoken")
    assert local.encode_ordinary(text) == tok.encode(text)


def test_unknown_tiktoken_encoding_lists_known_ones():
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'nope'; known ones: .*gpt2"):
        load_encoding("nope")


# ---------------------------------------------------------------- windows and text


def windows_of(data: torch.Tensor, block_size: int, stride: int = 1) -> TokenWindows:
    path = Path(tempfile.mkdtemp()) / "tokens.bin"
    data.numpy().astype(np.uint16).tofile(path)
    return TokenWindows(TokenStream([path], [len(data)], "uint16"), block_size, stride)


def test_windows_shift_targets_and_respect_the_stride():
    data = torch.arange(50)
    every = windows_of(data, 8)
    assert len(every) == 42
    x, y = every[3]
    assert torch.equal(x, data[3:11]) and torch.equal(y, data[4:12])
    windows = windows_of(data, 8, stride=8)
    assert [windows[i][0][0].item() for i in range(len(windows))] == [0, 8, 16, 24, 32, 40]
    strided = windows_of(data, 8, stride=4)
    assert [strided[i][0][0].item() for i in range(3)] == [0, 4, 8]
    with pytest.raises(IndexError):
        windows[6]
    with pytest.raises(ValueError, match="too few"):
        windows_of(torch.arange(5), 8)


def test_shakespeare_char_module_on_a_few_lines(tmp_path, monkeypatch):
    root = write_text_root(tmp_path, monkeypatch)
    dm = ShakespeareCharDataModule(
        root=str(root), block_size=16, batch_size=4, train_samples=8, prepared_dir=str(tmp_path)
    )
    dm.prepare_data()  # as the Trainer does, on one process
    dm.setup()
    split = int(len(TEXT) * 0.9)
    train, val = dm.streams["train"], dm.streams["val"]
    assert len(train) == split and len(val) == len(TEXT) - split
    assert dm.tokenizer.decode(val.read(0, len(val)).tolist()) == TEXT[split:]
    assert dm.model_kwargs() == {"vocab_size": len(set(TEXT)), "block_size": 16}
    assert (dm.folder / "tokenizer.json").exists()  # saved with the prepared tokens
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(list(dm.val_dataloader())) == -(-((len(val) - 17) // 16 + 1) // 4)
    # training windows start anywhere, drawn afresh each epoch by the sampler
    windows = {tuple(row.tolist()) for _ in range(3) for x, _ in dm.train_dataloader() for row in x}
    assert len(windows) > 4
    # the vocabulary travels in checkpoints (the in-memory module's state too)
    state = {"tokenizer": {"kind": "char", "chars": dm.tokenizer.chars.chars, "specials": []}}
    restored = ShakespeareCharDataModule(root=str(root), block_size=16, prepared_dir=str(tmp_path))
    restored.load_state_dict(state)
    restored.setup()
    assert restored.folder == dm.folder  # the same characters: the same prepared tokens
    assert restored.vocab_size == dm.vocab_size
    other = ShakespeareCharDataModule(root=str(root), block_size=16, prepared_dir=str(tmp_path))
    other.setup()
    other.load_state_dict({"tokenizer": {"kind": "char", "chars": list("ABC"), "specials": []}})
    with pytest.raises(ValueError, match="not in the vocabulary"):
        other.setup()  # the text has characters the checkpoint's vocabulary never saw


def test_shakespeare_bpe_module_with_a_local_encoding(tmp_path, monkeypatch):
    root = write_text_root(tmp_path, monkeypatch)
    write_ranks(tiny_ranks(), tmp_path / "tiny.tiktoken")
    dm = ShakespeareBPEDataModule(
        encoding="tiny",
        bpe_file=str(tmp_path / "tiny.tiktoken"),
        root=str(root),
        block_size=8,
        prepared_dir=str(tmp_path),
    )
    dm.setup()
    assert dm.vocab_size == 256 + 7
    split = int(len(TEXT) * 0.9)
    train = dm.streams["train"]
    assert dm.tokenizer.decode(train.read(0, len(train)).tolist()) == TEXT[:split]
    assert train.read(0, len(train)).tolist() == tiny_encoding().encode_ordinary(TEXT[:split])
    with pytest.raises(ValueError, match="trained with the tiktoken encoding 'gpt2'"):
        dm.load_state_dict({"tokenizer": {"kind": "tiktoken", "encoding": "gpt2", "specials": []}})


# ---------------------------------------------------------------- images


@pytest.mark.parametrize("module", [MNISTDataModule, FashionMNISTDataModule])
def test_mnist_modules_on_idx_files_the_test_writes(tmp_path, monkeypatch, module):
    raw = tmp_path / module.folder / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sizes = {"train": 40, "t10k": 12}
    for split, n in sizes.items():
        write_idx(raw / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,)))
    files = {p.name: sha256(p) for p in raw.glob("*.gz")}
    monkeypatch.setattr(module, "files", files)
    dm = module(root=str(tmp_path), batch_size=8, val_size=10, download=False)
    dm.prepare_data()
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (30, 10, 12)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 1, 28, 28) and x.dtype == torch.float32 and y.max() < 10
    assert dm.model_kwargs() == {"image_size": 28, "in_channels": 1, "num_classes": 10}


def test_mnist_archives_in_a_folder_that_cannot_be_written_are_one_clear_error(
    tmp_path, monkeypatch
):
    """A shared, read-only copy of the archives: unpacking beside them fails; the error
    names the folder and the two fixes, not a traceback from torchvision."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    monkeypatch.setattr(MNISTDataModule, "files", {})  # the archives are there and verified

    def unpack(self, train, augment, unpack=False):
        raise PermissionError(13, "Permission denied", str(raw / "train-images-idx3-ubyte"))

    monkeypatch.setattr(MNISTDataModule, "_dataset", unpack)
    dm = MNISTDataModule(root=str(tmp_path), download=False)
    with pytest.raises(DataFileError) as info:
        dm.prepare_data()
    said = str(info.value)
    assert f"MNIST's archives in {raw} are unpacked once beside them" in said
    assert "cannot be written (Permission denied)" in said and f"gunzip -k {raw}/*.gz" in said
    assert "point TLAB_DATA_DIR (or data.root=) at a folder you can write" in said


def test_digits_module_offline():
    dm = DigitsDataModule(batch_size=32)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == 1797
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 8, 8) and x.min() >= 0.0 and x.max() <= 1.0
    assert dm.model_kwargs() == {"image_size": 8, "in_channels": 1, "num_classes": 10}


# ---------------------------------------------------------------- translation


@pytest.mark.parametrize(("src_lang", "tgt_lang"), [("en", "de"), ("de", "en")])
def test_translation_module_on_gzipped_parallel_lines(tmp_path, monkeypatch, src_lang, tgt_lang):
    write_multi30k(tmp_path, monkeypatch)
    dm = TranslationDataModule(
        root=str(tmp_path),
        src_lang=src_lang,
        tgt_lang=tgt_lang,
        batch_size=4,
        bucket=2,
        download=False,
    )
    dm.setup()
    assert {k: len(v) for k, v in dm.sets.items()} == {"train": 6, "val": 6, "test": 6}
    kwargs = dm.model_kwargs()
    assert kwargs["src_vocab_size"] == dm.tokenizer.vocab_size
    src, tgt = next(iter(dm.val_dataloader()))
    side = 0 if src_lang == "en" else 1
    assert tgt[0, 0] == kwargs["bos_id"]
    assert dm.detokenize(tgt[0, 1:].tolist()) == PAIRS[0][1 - side]
    assert dm.detokenize(src[0].tolist()) == PAIRS[0][side]
    # padding fills the shorter pair of the batch
    assert (src[1] == kwargs["pad_id"]).any() and (src[1] == kwargs["eos_id"]).sum() == 1


def test_translation_module_with_the_word_tokenizer(tmp_path, monkeypatch):
    write_multi30k(tmp_path, monkeypatch)
    dm = TranslationDataModule(root=str(tmp_path), tokenizer="word", min_freq=2, download=False)
    dm.setup()
    src, tgt = next(iter(dm.val_dataloader()))
    assert dm.detokenize(tgt[0, 1:].tolist()) == PAIRS[0][1]
    # every word of the tiny corpus repeats, so each is one token: a sentence is a few ids
    assert (src[0] != dm.pad_id).sum() == len(split_pieces(PAIRS[0][0])) + 1  # + EOS
    # the vocabulary travels in checkpoints; a module built for characters adopts it
    other = TranslationDataModule(root=str(tmp_path), tokenizer="char", download=False)
    other.load_state_dict(dm.state_dict())
    other.setup()
    assert other.tokenizer.itos == dm.tokenizer.itos
    assert other.sets["val"].src == dm.sets["val"].src
    with pytest.raises(ValueError, match="valid ones are: char, word, tiktoken"):
        TranslationDataModule(root=str(tmp_path), tokenizer="words")


def test_bucketing_groups_similar_lengths_and_covers_every_pair():
    from torch.utils.data import RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    lengths = [1, 50, 2, 49, 3, 48, 4, 47]
    sampler = BucketBatchSampler(RandomSampler(lengths), batch_size=2, lengths=lengths, bucket=4)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(abs(lengths[a] - lengths[b]) < 5 for a, b in batches)
    assert len(sampler) == 4
    # under DDP, Lightning swaps the wrapped sampler: each rank then sees its own share
    # (it records the sampler's arguments while the Trainer asks for the dataloaders)
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler

    with _replace_dunder_methods(BatchSampler):
        sampler = BucketBatchSampler(RandomSampler(lengths), 2, lengths=lengths, bucket=4)
    loader = torch.utils.data.DataLoader(lengths, batch_sampler=sampler)
    shares = []
    for rank in (0, 1):
        dist = DistributedSampler(lengths, num_replicas=2, rank=rank, shuffle=True, seed=0)
        shares.append({i for b in _update_dataloader(loader, dist).batch_sampler for i in b})
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == set(range(8))


def test_iwslt_files(tmp_path):
    train = tmp_path / "iwslt2017" / "train.tags.en-de.en"
    train.parent.mkdir()
    train.write_text(
        "<url>http://x</url>\n<talkid>1</talkid>\nHello there.\n  <title>T</title>\nBye.\n"
    )
    xml = tmp_path / "iwslt2017" / "IWSLT17.TED.dev2010.en-de.en.xml"
    xml.write_text(
        '<refset>\n<doc docid="1">\n<seg id="1"> Good morning. </seg>\n'
        '<seg id="2">Yes.</seg>\n</doc></refset>\n'
    )
    assert read_iwslt_train(train) == ["Hello there.", "Bye."]
    assert read_iwslt_xml(xml) == ["Good morning.", "Yes."]
    odd = tmp_path / "odd.xml"
    odd.write_text('<seg id="1">Tom &amp; Jerry</seg>\n<seg id="2">two\nlines</seg>\n')
    assert read_iwslt_xml(odd) == ["Tom & Jerry", "two lines"]
    kept = tmp_path / "train.tags.x"
    kept.write_text("<talkid>3</talkid>\n<3 this talk\n")
    assert read_iwslt_train(kept) == ["<3 this talk"]
    for lang, lines in (("de", ["Hallo.", "Tschüss."]),):
        (train.parent / f"train.tags.en-de.{lang}").write_text("\n".join(lines) + "\n")
        (train.parent / f"IWSLT17.TED.dev2010.en-de.{lang}.xml").write_text(
            '<seg id="1">Guten Morgen.</seg><seg id="2">Ja.</seg>'
        )
    dm = TranslationDataModule(root=str(tmp_path), dataset="iwslt2017")
    assert dm.read_split("train") == (["Hello there.", "Bye."], ["Hallo.", "Tschüss."])
    assert dm.read_split("val")[1] == ["Guten Morgen.", "Ja."]
    with pytest.raises(DataFileError, match="tst2010.en-de.en.xml is missing"):
        dm.read_split("test")


# ---------------------------------------------------------------- synthetic


def test_mqar_answers_are_the_values_bound_earlier():
    inputs, labels = mqar(200, vocab_size=64, block_size=48, num_kv_pairs=6, seed=3)
    assert inputs.shape == labels.shape == (200, 48)
    for x, y in zip(inputs.tolist(), labels.tolist(), strict=True):
        bound = {x[i]: x[i + 1] for i in range(0, 12, 2)}
        assert all(k < 32 for k in bound) and all(v >= 32 for v in bound.values())
        answered = [(x[i], y[i]) for i in range(len(y)) if y[i] != -100]
        assert len(answered) == 6
        assert all(bound[key] == value for key, value in answered)
    again, _ = mqar(200, vocab_size=64, block_size=48, num_kv_pairs=6, seed=3)
    assert torch.equal(inputs, again)
    other, _ = mqar(200, vocab_size=64, block_size=48, num_kv_pairs=6, seed=4)
    assert not torch.equal(inputs, other)


def test_mqar_without_random_non_queries_is_zoologys_figure2_layout():
    noisy, labels = mqar(50, vocab_size=64, block_size=32, num_kv_pairs=4, seed=5)
    plain, same_labels = mqar(
        50, vocab_size=64, block_size=32, num_kv_pairs=4, seed=5, random_non_queries=False
    )
    assert torch.equal(labels, same_labels)  # the same pairs, queries and answers
    kept = labels != -100  # a query's key sits where its answer is the label
    kept[:, :8] = True  # the 4 pairs
    assert torch.equal(plain[kept], noisy[kept])
    assert (plain[~kept] == 0).all() and (noisy[~kept] != 0).float().mean() > 0.9


def test_mqar_gaps_follow_a_power_law():
    _, labels = mqar(2000, vocab_size=256, block_size=256, num_kv_pairs=4, seed=0)
    positions = (labels != -100).nonzero()[:, 1].float()
    first_half = (positions < 8 + (256 - 8) / 2).float().mean()
    assert first_half > 0.6  # a uniform placement would give 0.5


def test_mqar_rejects_impossible_settings():
    with pytest.raises(ValueError, match="block_size >= 4 \\* num_kv_pairs"):
        mqar(1, vocab_size=64, block_size=20, num_kv_pairs=8)


@pytest.mark.parametrize("task", ["copy", "sort"])
def test_copy_and_sort(task):
    inputs, labels = copy_or_sort(task, 50, vocab_size=10, length=6, seed=1)
    assert inputs.shape == labels.shape == (50, 12)
    x = inputs[:, :6]
    assert (inputs[:, 6] == 9).all()  # the separator
    expected = x if task == "copy" else x.sort(dim=1).values
    assert torch.equal(labels[:, 6:], expected)
    assert (labels[:, :6] == -100).all()


def test_synthetic_module_and_configs():
    dm = SyntheticDataModule(
        "mqar",
        vocab_size=64,
        block_size=32,
        num_kv_pairs=4,
        train_examples=20,
        val_examples=10,
        batch_size=5,
    )
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (5, 32)
    assert not torch.equal(dm.train_set.tensors[0][:10], dm.val_set.tensors[0])
    with pytest.raises(ValueError, match="unknown synthetic problem 'recall'"):
        SyntheticDataModule("recall")


@pytest.mark.parametrize("path", sorted((CONF / "data").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_data_config_instantiates(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TLAB_DATA_DIR", str(tmp_path))
    config = OmegaConf.load(path)
    if path.stem == "corpus":  # the user's text, and the run's seed
        config.merge_with({"sources": [str(path)], "order_seed": 0})
    dm = instantiate(config)
    assert hasattr(dm, "model_kwargs") and hasattr(dm, "train_dataloader")
    if hasattr(dm, "root"):
        assert dm.root == tmp_path


# ---------------------------------------------------------------- real data


def need(*files: str) -> None:
    missing = [f for f in files if not (REAL / f).exists()]
    if missing:
        pytest.skip(f"real data not found: {', '.join(missing)} under TLAB_DATA_DIR={REAL}")


def test_real_shakespeare_split(tmp_path):
    need("shakespeare/input.txt")
    dm = ShakespeareCharDataModule(root=str(REAL), download=False, prepared_dir=str(tmp_path))
    dm.setup()
    train, val = dm.streams["train"], dm.streams["val"]
    assert (len(train), len(val), dm.vocab_size) == (1_003_854, 111_540, 65)
    text = (REAL / "shakespeare" / "input.txt").read_text()
    tokens = np.concatenate([train.read(0, len(train)), val.read(0, len(val))])
    assert dm.tokenizer.decode(tokens.tolist()) == text


def unpacked(folder: str, names: list[str]) -> list[str]:
    """The files of an MNIST raw folder that are not archives (for copytree's ignore)."""
    return [n for n in names if (Path(folder) / n).is_file() and not n.endswith(".gz")]


def test_real_mnist_counts(tmp_path):
    need(*(f"MNIST/raw/{name}" for name in MNISTDataModule.files))
    # the archives alone (unpacking writes beside them; a run may have unpacked the real ones)
    shutil.copytree(REAL / "MNIST", tmp_path / "MNIST", ignore=unpacked)
    dm = MNISTDataModule(root=str(tmp_path), val_size=5000, download=False)
    with pytest.raises(DataFileError, match="call prepare_data"):
        dm.setup()
    dm.prepare_data()  # unpacks, as the Trainer does before setup
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) == 60_000 and len(dm.test_set) == 10_000


def test_real_multi30k_counts():
    need(*(f"multi30k/{name}" for name in translation_module.MULTI30K_FILES))
    dm = TranslationDataModule(root=str(REAL), download=False)
    dm.setup()
    assert [len(dm.raw[s][0]) for s in ("train", "val", "test")] == [29_000, 1_014, 1_000]
    assert [len(dm.sets[s]) for s in ("val", "test")] == [1_014, 1_000]
