"""run.overrides: the one reader of Hydra overrides."""

from __future__ import annotations

from transformers_lab.run.overrides import (
    BOOKKEEPING_KEYS,
    identity,
    override_key,
    override_map,
    overrides_in,
    parse,
    same_job,
)


def test_parse_splits_prefix_key_package_and_value():
    o = parse("++trainer.max_steps=10")
    assert (o.prefix, o.key, o.value) == ("++", "trainer.max_steps", "10")
    o = parse("~callbacks.early_stopping")
    assert (o.prefix, o.key, o.value) == ("~", "callbacks.early_stopping", None)
    o = parse("attention@model.attention=fastmax")
    assert (o.key, o.group, o.value) == ("attention@model.attention", "attention", "fastmax")
    assert parse("data.root='/a b'").unquoted() == "/a b"
    assert parse("x=a=b").value == "a=b"  # only the first = splits
    assert override_key("+trainer.x=1") == "trainer.x"


def test_flags_and_their_values_are_not_overrides():
    argv = ["-m", "--config-dir", "conf2", "seed=0,1", "+x=1", "--cfg=job"]
    assert [o.key for o in overrides_in(argv)] == ["seed", "x"]


def test_bookkeeping_keys_are_not_part_of_a_jobs_identity():
    assert set(BOOKKEEPING_KEYS) == {"skip_finished", "fail_fast", "summary", "trial"}
    first = ["attention=dot", "seed=1"]
    again = ["seed=1", "skip_finished=true", "attention=dot", "+fail_fast=true",
             "summary.baseline=attention=softmax", "trial=3"]  # fmt: skip
    assert identity(again) == ["seed=1", "attention=dot"]
    assert same_job(first, again)
    assert not same_job(first, ["attention=dot", "seed=2"])
    assert override_map(again) == {"seed": "1", "attention": "dot"}
    assert override_map(["~x", "y=2"]) == {"y": "2"}  # a deletion sets no value
