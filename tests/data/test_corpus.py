"""The corpus module on files the tests write: every source and tokenizer round-trips
through the shards, the split and the order are functions of their seeds, ranks read
disjoint windows, a resumed loader and a resumed preparation go on exactly, and bad input
is one line."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from transformers_lab.data.corpus import CorpusDataModule
from transformers_lab.data.corpus import prepare as prepare_module
from transformers_lab.data.corpus.prepare import read_json
from transformers_lab.data.corpus.windows import WindowOrder
from transformers_lab.errors import ConfigError, DataFileError

from fake_data import tiny_ranks, write_hf_tokenizer, write_ranks

WORDS = ["the", "speak", "sea", "shore", "king", "crown", "night", "day", "love", "war"]


def documents(n: int = 40, seed: int = 0) -> list[str]:
    """``n`` documents of a few lines of words (no blank lines inside one)."""
    rng = random.Random(seed)
    return [
        "\n".join(
            " ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(rng.randint(1, 4))
        )
        for _ in range(n)
    ]


def write_sentencepiece(path: Path, texts: list[str]) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts * 5),
        model_prefix=str(path.with_suffix("")),
        vocab_size=320,
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        byte_fallback=True,
        minloglevel=2,
    )
    return path


def module(tmp_path: Path, sources, **kwargs) -> CorpusDataModule:
    kwargs = {
        "tokenizer": "char",
        "block_size": 8,
        "batch_size": 4,
        "train_samples": 16,
        "val_fraction": 0.2,
        "prepare_workers": 1,
        **kwargs,
    }
    sources = OmegaConf.create(sources)  # as Hydra gives it: a ListConfig of DictConfigs
    dm = CorpusDataModule(sources=sources, prepared_dir=str(tmp_path / "prepared"), **kwargs)
    dm.prepare_data()
    dm.setup()
    return dm


def decoded_documents(dm: CorpusDataModule) -> list[str]:
    """Every document in the shards, decoded (split at the end-of-text id)."""
    docs = []
    for split in ("train", "val"):
        stream = dm.streams[split]
        ids = stream.read(0, len(stream)) if len(stream) else np.empty(0, np.int64)
        ends = np.flatnonzero(ids == dm.tokenizer.eot_id)
        starts = np.concatenate([[0], ends[:-1] + 1])
        docs += [dm.tokenizer.decode(ids[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    return docs


def write_sources(tmp_path: Path, docs: list[str]) -> dict[str, object]:
    """The same documents as each kind of source."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(docs):
        (folder / f"{i:03d}.txt").write_text(doc)
    (tmp_path / "paragraphs.txt").write_text("\n\n".join(docs) + "\n")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "docs.json").write_text(json.dumps([{"body": d} for d in docs]))
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    return {
        "txt files (a glob)": str(folder / "*.txt"),
        "txt folder": str(folder),
        "txt paragraphs": {"path": str(tmp_path / "paragraphs.txt"), "documents": "paragraphs"},
        "jsonl": str(tmp_path / "docs.jsonl"),
        "json array": {"path": str(tmp_path / "docs.json"), "field": "body"},
        "parquet": str(tmp_path / "docs.parquet"),
        "saved data set": str(tmp_path / "saved"),
    }


def test_every_source_round_trips_through_the_shards(tmp_path):
    docs = documents()
    for name, source in write_sources(tmp_path, docs).items():
        dm = module(tmp_path / name.replace(" ", "_"), [source], chunk_bytes=1024, shard_bytes=2048)
        got = decoded_documents(dm)
        expected = [d.strip("\n") for d in docs] if "paragraphs" in name else docs
        assert sorted(got) == sorted(expected), name
        manifest = dm.manifest
        assert manifest["documents"]["total"] == len(docs), name
        assert manifest["documents"]["train"] + manifest["documents"]["val"] == len(docs), name
        assert manifest["tokens"]["val"] > 0 and manifest["tokens"]["train"] > 0, name


@pytest.mark.parametrize("kind", ["char", "tiktoken", "huggingface", "sentencepiece"])
def test_every_tokenizer_round_trips_and_travels_in_the_state(tmp_path, kind):
    docs = documents(30)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    spec = {
        "char": lambda: "char",
        "tiktoken": lambda: write_ranks(tiny_ranks(), tmp_path / "tiny.tiktoken"),
        "huggingface": lambda: write_hf_tokenizer(tmp_path / "tokenizer.json", docs),
        "sentencepiece": lambda: write_sentencepiece(tmp_path / "sp.model", docs),
    }[kind]()
    spec = str(spec)
    dm = module(tmp_path, [str(tmp_path / "docs.jsonl")], tokenizer=spec)
    assert sorted(decoded_documents(dm)) == sorted(docs)
    assert dm.tokenizer.kind == kind
    assert dm.manifest["dtype"] == "uint16"
    # the checkpoint's state rebuilds it with no file beside it
    for f in tmp_path.glob("*.tiktoken"):
        f.unlink()
    restored = CorpusDataModule(
        sources=[str(tmp_path / "docs.jsonl")],
        tokenizer=spec,
        prepared_dir=str(tmp_path / "prepared"),
        block_size=8,
    )
    restored.load_state_dict(dm.state_dict())
    assert restored.tokenize(docs[0]) == dm.tokenize(docs[0])
    assert restored.detokenize(dm.tokenize(docs[0])) == docs[0]


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path):
    chars = [chr(0x4E00 + i) for i in range(20_000)] + [chr(0x20000 + i) for i in range(50_000)]
    (tmp_path / "a.txt").write_text("".join(chars) * 2, encoding="utf-8")
    dm = module(tmp_path, [str(tmp_path / "a.txt")], block_size=4, split="tail")
    assert dm.vocab_size == 70_001 and dm.manifest["dtype"] == "uint32"
    assert dm.detokenize(dm.streams["train"].read(0, 70_000).tolist()) == "".join(chars)


def test_the_split_and_the_order_are_functions_of_their_seeds(tmp_path):
    docs = documents(200)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    source = [str(tmp_path / "docs.jsonl")]

    def split(workers, seed, chunk):
        dm = module(
            tmp_path / f"{workers}-{seed}-{chunk}",
            source,
            split_seed=seed,
            prepare_workers=workers,
            chunk_bytes=chunk,
            shard_bytes=4 * chunk,
            order_seed=7,
        )
        val = dm.streams["val"].read(0, len(dm.streams["val"]))
        batches = [torch.cat(b) for b in dm.train_dataloader()]
        return val, batches, dm.manifest

    val, batches, manifest = split(1, 0, 2048)
    val2, batches2, manifest2 = split(2, 0, 2048)  # two processes: the same shards
    assert np.array_equal(val, val2) and all(map(torch.equal, batches, batches2))
    assert [s["train"]["sha256"] for s in manifest["shards"]] == [
        s["train"]["sha256"] for s in manifest2["shards"]
    ]
    assert len(manifest["shards"]) > 1
    other, _, _ = split(1, 1, 2048)
    assert not np.array_equal(val, other)
    cut_otherwise, _, _ = split(1, 0, 8192)  # a document's key is where it lies, not its task
    assert np.array_equal(val, cut_otherwise)
    assert 0.1 < manifest["documents"]["val"] / len(docs) < 0.32  # val_fraction 0.2


def test_ranks_read_disjoint_reproducible_positions_with_any_number_of_workers(tmp_path):
    docs = documents(100)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dm = module(tmp_path, [str(tmp_path / "docs.jsonl")], train_samples=64, order_seed=3)
    whole = list(WindowOrder(500, 64, seed=3, num_replicas=1, rank=0))
    ranks = [list(WindowOrder(500, 64, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    assert ranks[0] == whole[0::2] and ranks[1] == whole[1::2]  # disjoint positions, all of them
    order = WindowOrder(500, 64, seed=3)
    order.set_epoch(1)
    assert list(order) != whole  # a new epoch, a new order
    loaders = [dm.train_dataloader()]
    dm.num_workers = 2
    loaders.append(dm.train_dataloader())
    first, second = ([torch.cat(b) for b in loader] for loader in loaders)
    assert all(map(torch.equal, first, second))  # workers fetch what the sampler chose


def test_a_resumed_loader_gives_the_batches_the_uninterrupted_one_gave(tmp_path):
    docs = documents(100)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for seed in (None, 5):
        dm = module(tmp_path, [str(tmp_path / "docs.jsonl")], train_samples=40, order_seed=seed)
        loader = dm.train_dataloader()
        torch.manual_seed(1)
        batches = iter(loader)
        seen = [torch.cat(next(batches)) for _ in range(4)]
        state, rng = loader.state_dict(), torch.get_rng_state()
        rest = [torch.cat(b) for b in batches]
        torch.manual_seed(99)  # a new process: another random state until the checkpoint's
        resumed = module(
            tmp_path, [str(tmp_path / "docs.jsonl")], train_samples=40, order_seed=seed
        ).train_dataloader()
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)
        again = [torch.cat(b) for b in resumed]
        assert len(seen) + len(rest) == len(loader) and len(again) == len(rest)
        assert all(map(torch.equal, again, rest)), seed
        assert torch.equal(torch.get_rng_state(), rng)  # resuming drew nothing


def test_a_preparation_cut_short_resumes_to_the_same_shards(tmp_path, monkeypatch):
    docs = documents(300)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    source = [str(tmp_path / "docs.jsonl")]
    kwargs = {"chunk_bytes": 1024, "shard_bytes": 2048}
    whole = module(tmp_path / "whole", source, **kwargs).manifest

    write_shard = prepare_module.write_shard

    def crash_on_third(folder, index, results, dtype):
        if index == 2:
            next(iter(results))
            (folder / ".train-00002.bin.part").write_bytes(b"\0" * 10)  # as a kill leaves it
            raise KeyboardInterrupt
        return write_shard(folder, index, results, dtype)

    monkeypatch.setattr(prepare_module, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        module(tmp_path / "cut", source, **kwargs)
    folder = next(p for p in (tmp_path / "cut" / "prepared").glob("docs-*") if p.is_dir())
    assert not (folder / "manifest.json").exists()
    assert sorted(p.name for p in folder.glob("shard-*.json")) == [
        "shard-00000.json",
        "shard-00001.json",
    ]
    monkeypatch.setattr(prepare_module, "write_shard", write_shard)
    made = []
    monkeypatch.setattr(
        prepare_module,
        "_do_task",
        lambda task, f=prepare_module._do_task: made.append(task) or f(task),
    )
    resumed = module(tmp_path / "cut", source, **kwargs).manifest
    assert resumed["shards"] == whole["shards"] and resumed["tokens"] == whole["tokens"]
    plan = read_json(folder / "plan.json")
    assert len(made) == len(plan["tasks"]) - plan["shards"][2][0]  # only the shards not made


def test_a_prepared_corpus_is_found_again_and_a_changed_source_prepared_again(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    dm = module(tmp_path, [str(tmp_path / "a.txt")], split="tail")
    manifest_file = dm.folder / "manifest.json"
    made = manifest_file.stat().st_mtime_ns
    again = module(tmp_path, [str(tmp_path / "a.txt")], split="tail")
    assert again.folder == dm.folder and manifest_file.stat().st_mtime_ns == made
    os.utime(tmp_path / "a.txt", ns=(1, 1))  # touched, not changed: the same corpus
    module(tmp_path, [str(tmp_path / "a.txt")], split="tail")
    assert json.loads(manifest_file.read_text())["sources"][0]["mtime_ns"] == 1  # a stat next
    (tmp_path / "a.txt").write_text("goodbye moon\n" * 50)
    with caplog.at_level("WARNING"):
        changed = module(tmp_path, [str(tmp_path / "a.txt")], split="tail")
    assert "changed since it was prepared" in caplog.text
    assert changed.detokenize(changed.streams["train"].read(0, 12).tolist()) == "goodbye moon"


def test_a_corpus_can_be_read_from_its_prepared_folder_alone(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    dm = module(tmp_path, [str(tmp_path / "a.txt")], split="tail")
    alone = CorpusDataModule(prepared=str(dm.folder), tokenizer=None, block_size=8)
    alone.setup()
    assert alone.vocab_size == dm.vocab_size
    x, y = next(iter(alone.val_dataloader()))
    assert x.shape[1] == 8
    bpe = module(tmp_path / "bpe", [str(tmp_path / "a.txt")], split="tail",
                 tokenizer=str(write_ranks(tiny_ranks(), tmp_path / "tiny.tiktoken")))  # fmt: skip
    with pytest.raises(ConfigError, match="not by characters as data.tokenizer=char asks"):
        CorpusDataModule(prepared=str(bpe.folder), tokenizer="char", block_size=8).setup()
    with pytest.raises(ConfigError, match="was prepared with the tokenizer char"):
        CorpusDataModule(
            prepared=str(dm.folder),
            tokenizer=str(write_ranks(tiny_ranks(), tmp_path / "t.tiktoken")),
            block_size=8,
        ).setup()


def test_the_validation_budget_is_in_tokens(tmp_path):
    docs = documents(200)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dm = module(tmp_path, [str(tmp_path / "docs.jsonl")], val_tokens=81)
    assert len(dm.streams["val"]) == 81
    assert sum(len(x) for x, _ in dm.val_dataloader()) == 10  # (81 - 1) // 8 windows


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("no match", ConfigError, r"'.*nothing\*.txt' matches no file"),
        ("empty file", ConfigError, r"empty.txt is empty"),
        ("no text", ConfigError, r"data.sources hold no text"),
        ("jsonl without the field", DataFileError, r"bad.jsonl line 3 has no field 'text'"),
        (
            "parquet without the column",
            DataFileError,
            r"has no column 'text' \(it has \['body'\]\)",
        ),
        (
            "missing tokenizer",
            DataFileError,
            r"the Hugging Face tokenizer file .*nope.json does not exist",
        ),
        ("unreadable tokenizer", DataFileError, r"is not a Hugging Face tokenizer.json"),
        ("block_size past the validation split", ConfigError, r"validation split .* too few"),
    ],
)
def test_bad_input_is_one_line(tmp_path, case, error, match):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "ok.txt").write_text("some text " * 100)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n\n{"body": "b"}\n')
    (tmp_path / "garbage.json").write_text("{not a tokenizer")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    sources, kwargs = {
        "no match": ([str(tmp_path / "nothing*.txt")], {}),
        "empty file": ([str(tmp_path / "empty.txt")], {}),
        "no text": ([str(tmp_path / "blank.jsonl")], {}),
        "jsonl without the field": ([str(tmp_path / "bad.jsonl")], {}),
        "parquet without the column": ([str(tmp_path / "bad.parquet")], {}),
        "missing tokenizer": (
            [str(tmp_path / "ok.txt")],
            {"tokenizer": str(tmp_path / "nope.json")},
        ),
        "unreadable tokenizer": (
            [str(tmp_path / "ok.txt")],
            {"tokenizer": str(tmp_path / "garbage.json")},
        ),
        "block_size past the validation split": (
            [str(tmp_path / "ok.txt")],
            {"split": "tail", "val_fraction": 0.01, "block_size": 64},
        ),
    }[case]
    with pytest.raises(error, match=match) as caught:
        module(tmp_path, sources, **kwargs)
    assert "\n" not in str(caught.value)


def test_the_litdata_backend_streams_the_same_tokens_and_resumes(tmp_path):
    from transformers_lab.data.corpus import stream

    docs = documents(300)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    source = [str(tmp_path / "docs.jsonl")]
    dm = module(tmp_path, source, backend="litdata", order_seed=0, train_samples=10**6)
    loader = dm.train_dataloader()
    tokens = dm.streams["train"].read(0, len(dm.streams["train"]))
    in_order = stream.streaming_loader(str(dm.folder / "litdata"), "train", 8, 4, 0, 0, False)
    windows = [torch.cat([x, y[:, -1:]], 1) for x, y in in_order]
    streamed = torch.cat(windows).flatten().numpy()
    assert len(streamed) == len(tokens) // 9 * 9 and np.array_equal(
        streamed, tokens[: len(streamed)]
    )
    batches = iter(loader)
    seen = [torch.cat(next(batches)) for _ in range(3)]
    state = loader.state_dict()
    rest = [torch.cat(b) for b in batches]
    assert len(seen) + len(rest) == len(tokens) // 9 // 4  # every window once, shuffled
    resumed = module(tmp_path, source, backend="litdata", order_seed=0).train_dataloader()
    resumed.load_state_dict(state)
    again = [torch.cat(b) for b in resumed]
    assert len(again) == len(rest) and all(map(torch.equal, again, rest))


def test_a_tail_split_of_a_text_larger_than_a_task_ends_each_part_once(tmp_path):
    lines = [" ".join(random.Random(i).choices(WORDS, k=12)) for i in range(600)]
    text = "\n".join(lines) + "\n"
    (tmp_path / "book.txt").write_text(text)
    dm = module(tmp_path, [str(tmp_path / "book.txt")], split="tail", val_fraction=0.1,
                chunk_bytes=1024, eot=True)  # fmt: skip
    assert len(read_json(dm.folder / "plan.json")["tasks"]) > 10
    train, val = (dm.streams[s].read(0, len(dm.streams[s])) for s in ("train", "val"))
    eot = dm.tokenizer.eot_id
    assert list(np.flatnonzero(train == eot)) == [len(train) - 1]  # the head ends once
    assert list(np.flatnonzero(val == eot)) == [len(val) - 1]  # and the tail at the end
    assert dm.detokenize(train.tolist()) + dm.detokenize(val.tolist()) == text
    assert dm.manifest["documents"] == {"train": 1, "val": 1, "total": 1}
    cut = len(dm.detokenize(train.tolist()).encode())
    assert abs(cut - 0.9 * len(text.encode())) < 1024  # the cut, near 90% of the bytes
