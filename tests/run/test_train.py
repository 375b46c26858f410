"""The training pipeline: the real configs composed as tlab-train composes them, runs of
tlab-train, tlab-eval and tlab-sample, resume, logging, and one-line errors."""

from __future__ import annotations

import csv
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from transformers_lab.attention import KERNELS
from transformers_lab.cli import check_overrides, run_dir_folder
from transformers_lab.config import CONF_DIR, compose_config
from transformers_lab.errors import ConfigError
from transformers_lab.eval import evaluate
from transformers_lab.run.budget import TOKEN_KEYS
from transformers_lab.run.components import build_datamodule, build_model
from transformers_lab.run.fit import train
from transformers_lab.sample import sample

from fake_data import fake_data_root

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
# a small ViT on digits: a real fit in about a second
SMALL = [
    "logger=csv",
    "model.d_model=32",
    "model.n_layer=1",
    "model.n_head=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


compose_run = compose_config


@pytest.fixture
def data_root(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("TLAB_ROOT", raising=False)
    return fake_data_root(tmp_path / "data", monkeypatch)


def run_train(tmp_path: Path, overrides: list[str], name: str = "run") -> dict[str, float]:
    return train(compose_run("train", overrides, tmp_path / name))


def read_csv_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ experiments


@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
def test_every_experiment_composes_and_runs_a_fast_dev_run(experiment, data_root, tmp_path):
    overrides = ["debug=fdr", "data.batch_size=4", "trainer.enable_progress_bar=false"]
    if experiment is not None:
        overrides.append(f"experiment={experiment}")
    if experiment == "gpt_long_context":  # the test's small text holds no window of 4096
        overrides.append("data.block_size=128")
    if experiment is not None and experiment.startswith("lra_"):  # a few examples drawn
        overrides += ["data.train_examples=32", "data.val_examples=8", "data.test_examples=8"]
        overrides.append("data.cache_dir=null")
    cfg = compose_run("train", overrides, tmp_path / "run")
    metrics = train(cfg)
    assert metrics and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert "train/loss" in metrics and cfg.monitor.metric in metrics


def test_a_checkpoint_the_callback_names_but_never_wrote_is_none(tmp_path):
    """Lightning's fast_dev_run may save no checkpoint and still set last_model_path: the
    run's outcome and report name only checkpoints that exist."""
    from types import SimpleNamespace

    from transformers_lab.run.fit import checkpoint_path

    written = tmp_path / "best.ckpt"
    written.write_bytes(b"x")
    callback = SimpleNamespace(best_model_path=str(written), last_model_path=str(tmp_path / "no"))
    trainer = SimpleNamespace(checkpoint_callback=callback)
    assert checkpoint_path(trainer, "best_model_path") == str(written)
    assert checkpoint_path(trainer, "last_model_path") is None
    assert checkpoint_path(SimpleNamespace(checkpoint_callback=None), "best_model_path") is None


def test_the_experiments_are_the_promised_ones():
    expected = {"baby_gpt", "gpt_shakespeare", "vit_mnist", "vit_mnist_fastmax", "mqar"}
    assert expected | {"transformer_multi30k"} <= set(EXPERIMENTS)


def test_zoology_mqar_is_zoologys_figure2_cell(tmp_path):
    cfg = compose_run("train", ["experiment=zoology_mqar"], tmp_path / "run")
    m, d, o, s = cfg.model, cfg.data, cfg.optimizer, cfg.scheduler
    assert (m.n_layer, m.n_head, m.d_model, m.mlp_ratio, m.dropout) == (2, 1, 64, 0, 0.1)
    assert m.pos_encoding == "learned"
    assert (d.vocab_size, d.block_size, d.num_kv_pairs, d.power_a) == (8192, 64, 4, 0.01)
    assert (d.train_examples, d.val_examples, d.batch_size) == (100_000, 3000, 512)
    assert d.random_non_queries is False
    assert (o.weight_decay, s.warmup_steps, s.min_lr_ratio) == (0.1, 0, 0.0)
    stop = cfg.callbacks.early_stopping
    assert (stop.monitor, stop.mode, stop.stopping_threshold) == ("val/acc", "max", 0.99)


def test_baby_gpt_is_nanogpts_cpu_config(tmp_path):
    cfg = compose_run("train", ["experiment=baby_gpt"], tmp_path / "run")
    m, d, o, s, t = cfg.model, cfg.data, cfg.optimizer, cfg.scheduler, cfg.trainer
    assert (m.n_layer, m.n_head, m.d_model, m.dropout, m.bias) == (4, 4, 128, 0.0, False)
    assert (d.block_size, d.batch_size) == (64, 12)
    assert (o.lr, list(o.betas), o.weight_decay) == (1e-3, [0.9, 0.99], 0.1)
    # the schedule's length is the run's (nanoGPT's lr_decay_iters = max_iters = 2000)
    assert (s.warmup_steps, s.max_steps, s.min_lr_ratio) == (100, None, 0.1)
    assert (t.max_steps, t.gradient_clip_val) == (2000, 1.0)


def test_vit_mnist_fastmax_is_the_notebooks_model(tmp_path, data_root):
    cfg = compose_run("train", ["experiment=vit_mnist_fastmax"], tmp_path / "run")
    dm = build_datamodule(cfg.data)
    model = build_model(cfg.model, dm)
    kernels = [m for m in model.modules() if isinstance(m, tuple(KERNELS.values()))]
    assert len(kernels) == 3 and all(isinstance(k, KERNELS["fastmax"]) for k in kernels)
    assert all(k.p == 2 for k in kernels)
    assert model.embedding.proj.kernel_size == (5, 5) and model.embedding.num_patches == 36
    mlp_widths = {m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert 24 in mlp_widths  # MLP width 24 = 1.6 * 15
    assert (len(model.blocks), cfg.model.d_model, cfg.model.n_head) == (3, 15, 5)
    assert (cfg.data.batch_size, cfg.optimizer.lr, cfg.trainer.max_epochs) == (32, 1e-3, 2)


# ------------------------------------------------------------------ attention and models


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("model", ["gpt", "vit", "encoder", "transformer"])
def test_attention_override_changes_the_kernel_in_the_built_model(
    kernel, model, tmp_path, data_root
):
    data = {"gpt": "mqar", "vit": "digits", "encoder": "digits", "transformer": "multi30k"}
    overrides = [f"model={model}", f"attention={kernel}", f"data={data[model]}"]
    cfg = compose_run("train", overrides, tmp_path / "r")
    if model != "gpt" and KERNELS[kernel].causal_only:  # refused, in one line
        with pytest.raises(ConfigError, match=f"attends .*attention={kernel} .*causal only"):
            build_model(cfg.model, build_datamodule(cfg.data))
        return
    if model == "transformer" and getattr(KERNELS[kernel], "positional", False):
        with pytest.raises(ValueError, match="another cross_attention kernel"):
            build_model(cfg.model, build_datamodule(cfg.data))  # cosformer: not across
        return
    built = build_model(cfg.model, build_datamodule(cfg.data))
    found = {type(m) for m in built.modules() if isinstance(m, tuple(KERNELS.values()))}
    assert found == {KERNELS[kernel]}


def test_kernel_options_reach_every_layer(tmp_path, data_root):
    overrides = ["model=gpt", "data=mqar", "attention=fastmax", "attention.p=1"]
    overrides += ["attention.normalize=true", "attention.scale=0.5"]
    cfg = compose_run("train", overrides, tmp_path / "r")
    built = build_model(cfg.model, build_datamodule(cfg.data))
    kernels = [m for m in built.modules() if isinstance(m, KERNELS["fastmax"])]
    assert len(kernels) == cfg.model.n_layer and all(k.p == 1 for k in kernels)


@pytest.mark.parametrize("group", ["trainer", "logger", "callbacks", "optimizer", "scheduler"])
def test_every_option_of_the_plain_groups_composes(group, tmp_path):
    """Each option composes, and its keys are arguments of what it instantiates."""
    import inspect

    from transformers_lab.run.components import target_class

    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        cfg = compose_run("train", [f"{group}={path.stem}"], tmp_path / "r")
        node = cfg.get(group)
        nodes = [] if node is None else [node] if "_target_" in node else list(node.values())
        for sub in nodes:
            params = inspect.signature(target_class(sub)).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            unknown = {k for k in sub if not k.startswith("_")} - set(params)
            if group == "trainer":  # the token budget's, which Lightning does not take
                unknown -= set(TOKEN_KEYS)
            assert not unknown, f"conf/{group}/{path.name}: {unknown}"


@pytest.mark.parametrize(
    "overrides",
    [
        ["logger=many"],  # csv, wandb (offline here) and tensorboard together
        ["logger=none", "callbacks=none"],
        ["callbacks=early_stopping", "callbacks.early_stopping.patience=1"],
        ["scheduler=none", "optimizer=sgd", "trainer.accumulate_grad_batches=2"],
        ["optimizer=adam", "scheduler=noam", "trainer.gradient_clip_val=0.5"],
    ],
    ids=["all-loggers", "bare", "early-stopping", "sgd-accumulate", "noam-clip"],
)
def test_logger_callback_and_optimizer_options_train(overrides, tmp_path):
    small = [o for o in SMALL if not o.startswith("logger=")]
    metrics = run_train(tmp_path, [*small, "trainer.max_epochs=2", "test=false", *overrides])
    assert "val/acc" in metrics
    run_dir = tmp_path / "run"
    if "logger=many" in overrides:
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
        assert (run_dir / "csv" / "metrics.csv").is_file() and (run_dir / "wandb").is_dir()
    if "callbacks=none" in overrides:
        assert not (run_dir / "checkpoints").exists()


# ------------------------------------------------------------------ runs, eval, resume


def test_a_run_prints_its_dir_metrics_and_checkpoints(tmp_path, capsys):
    # monitor.mode=min keeps the worst epoch as "best": the first, before last.ckpt existed
    metrics = run_train(tmp_path, [*SMALL, "trainer.max_epochs=2", "monitor.mode=min"])
    out = capsys.readouterr().out
    run_dir = tmp_path / "run"
    assert out.startswith(f"run dir: {run_dir}")
    assert "final metrics:" in out and f"val/acc: {metrics['val/acc']:.6g}" in out
    assert f"best checkpoint: {run_dir / 'checkpoints' / 'best.ckpt'}" in out
    assert f"last checkpoint: {run_dir / 'checkpoints' / 'last.ckpt'}" in out
    assert {"val/acc", "val/acc_best", "test/acc", "test/loss"} <= set(metrics)
    # the composed config, the metrics and the hyperparameters with the parameter count
    assert (run_dir / "csv" / "metrics.csv").is_file()
    hparams = (run_dir / "csv" / "hparams.yaml").read_text()
    assert "model/params:" in hparams and "d_model: 32" in hparams


def test_train_then_eval_reproduces_the_validation_metric(tmp_path):
    run_train(tmp_path, [*SMALL, "trainer.max_epochs=3"])
    best = tmp_path / "run" / "checkpoints" / "best.ckpt"
    saved = torch.load(best, map_location="cpu", weights_only=False)
    callback = next(v for k, v in saved["callbacks"].items() if k.startswith("Checkpoint"))
    logged = float(callback["best_model_score"])
    for split in ("val", "test"):
        cfg = compose_run(
            "eval",
            [f"ckpt_path={best}", f"split={split}", "logger=csv"],
            tmp_path / f"eval-{split}",
        )
        metrics = evaluate(cfg)
        assert f"{split}/acc" in metrics
    cfg = compose_run("eval", [f"ckpt_path={best}", "logger=csv"], tmp_path / "eval")
    assert evaluate(cfg)["val/acc"] == pytest.approx(logged, abs=1e-6)


def test_eval_takes_cpu_threads_as_train_does(tmp_path, monkeypatch):
    one_batch = ["trainer.max_epochs=1", "trainer.limit_train_batches=1", "test=false"]
    run_train(tmp_path, [*SMALL, *one_batch, "trainer.limit_val_batches=1"])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)  # the tests' own stay
    overrides = [f"ckpt_path={last}", "logger=csv", "cpu_threads=1"]
    metrics = evaluate(compose_run("eval", overrides, tmp_path / "eval"))
    assert threads == [1] and "val/acc" in metrics


def test_resume_from_last_continues_the_global_step_and_the_schedule(tmp_path, capsys):
    limit = [*SMALL, "trainer.limit_train_batches=3", "test=false"]
    run_train(tmp_path, [*limit, "trainer.max_epochs=2"], "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    first = torch.load(last, map_location="cpu", weights_only=False)
    assert first["global_step"] == 6
    run_train(tmp_path, [*limit, "trainer.max_epochs=4", f"ckpt_path={last}"], "resumed")
    resumed = torch.load(
        tmp_path / "resumed" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
    )
    assert resumed["global_step"] == 12 and resumed["epoch"] == 3
    # the schedule went on from step 6, it did not restart its warm-up
    assert resumed["lr_schedulers"][0]["last_epoch"] == 12
    # the optimizer's moments were restored, not rebuilt: Adam's step count goes on
    steps = {float(s["step"]) for s in resumed["optimizer_states"][0]["state"].values()}
    assert steps == {12.0}
    logged = [int(r["step"]) for r in read_csv_metrics(tmp_path / "resumed") if r["train/loss"]]
    assert logged and min(logged) >= 6
    # a finished run resumed with the same limits trains nothing, and says so
    capsys.readouterr()
    done = tmp_path / "resumed" / "checkpoints" / "last.ckpt"
    run_train(tmp_path, [*limit, "trainer.max_epochs=4", f"ckpt_path={done}"], "again")
    out = capsys.readouterr().out
    assert f"nothing left to train: {done} is at global step 12, where the trainer's " in out
    assert "max_epochs=4, max_steps=-1 end the run" in out
    # one with lower limits than it has reached: Lightning's refusal, as a ConfigError
    with pytest.raises(ConfigError, match=r"current_epoch=3, but you have set .*max_epochs=2"):
        run_train(tmp_path, [*limit, "trainer.max_epochs=2", f"ckpt_path={done}"], "lower")


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ["scheduler.max_steps=50"],
            "scheduler.max_steps=50 must exceed warmup_steps=100",
        ),
        (["trainer.val_check_interval=1000"], "trainer.check_val_every_n_epoch=null to count"),
    ],
    ids=["schedule-shorter-than-warm-up", "validation-beyond-an-epoch"],
)
def test_settings_that_cannot_train_are_one_config_error(tmp_path, overrides, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        run_train(tmp_path, ["trainer.max_steps=3", *overrides], "r")


@pytest.mark.parametrize(("max_steps", "validated"), [(14, [9, 13]), (20, [9, 19])])
def test_a_run_ended_by_max_steps_validates_its_final_weights_once(tmp_path, max_steps, validated):
    # digits in batches of 128: 10 batches an epoch, validated at each epoch's end; 14
    # steps end in the middle of the second epoch, 20 at its end (no second validation)
    overrides = [*SMALL, "data.batch_size=128", f"trainer.max_steps={max_steps}"]
    metrics = run_train(tmp_path, [*overrides, "trainer.max_epochs=-1", "test=false"])
    rows = [r for r in read_csv_metrics(tmp_path / "run") if r["val/loss"]]
    assert [int(r["step"]) for r in rows] == validated  # the step logged is global_step - 1
    assert metrics["val/loss"] == pytest.approx(float(rows[-1]["val/loss"]))
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["global_step"] == max_steps
    best = next(v for k, v in last["callbacks"].items() if k.startswith("Checkpoint"))
    assert float(best["best_model_score"]) == max(float(r["val/acc"]) for r in rows)


def test_train_false_tests_the_checkpoint_it_is_given(tmp_path):
    trained = run_train(tmp_path, [*SMALL, "trainer.max_epochs=2"])
    best = tmp_path / "run" / "checkpoints" / "best.ckpt"
    tested = run_train(tmp_path, [*SMALL, "train=false", f"ckpt_path={best}"], "test-only")
    assert tested["test/acc"] == trained["test/acc"]
    assert tested["test/loss"] == pytest.approx(trained["test/loss"])
    untrained = run_train(tmp_path, [*SMALL, "train=false"], "untrained")
    assert untrained["test/loss"] != pytest.approx(trained["test/loss"])


def test_a_checkpoint_of_another_model_config_is_refused_in_one_line(tmp_path):
    run_train(tmp_path, [*SMALL, "trainer.max_epochs=1", "test=false"])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"another config: model.d_model: 32 -> 48; resume"):
        run_train(tmp_path, [*SMALL, "model.d_model=48", f"ckpt_path={last}"], "other")
    with pytest.raises(ConfigError, match="no checkpoint at"):
        run_train(tmp_path, [*SMALL, f"ckpt_path={tmp_path / 'nope.ckpt'}"], "missing")


def test_sample_generates_from_a_gpt_checkpoint(tmp_path, data_root, capsys):
    overrides = [
        "logger=csv",
        "model=gpt",
        "data=shakespeare_char",
        "data.block_size=16",
        "data.train_samples=64",
        "model.n_layer=1",
        "model.d_model=16",
        "model.n_head=2",
        "trainer.max_epochs=1",
        "task.sample_tokens=8",
        "trainer.enable_progress_bar=false",
    ]
    metrics = run_train(tmp_path, overrides)
    assert {"val/ppl", "val/bpt", "val/acc"} <= set(metrics)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    cfg = compose_run(
        "sample",
        [f"ckpt_path={last}", "prompt=Before", "num_samples=2", "max_new_tokens=12"],
        tmp_path / "sample",
    )
    texts = sample(cfg)
    assert len(texts) == 2 and all(t.startswith("Before") and len(t) == 6 + 12 for t in texts)
    assert texts[0] in capsys.readouterr().out


def test_sample_refuses_a_checkpoint_that_is_not_a_language_model(tmp_path):
    run_train(tmp_path, [*SMALL, "trainer.max_epochs=1", "test=false"])
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    cfg = compose_run("sample", [f"ckpt_path={last}"], tmp_path / "sample")
    with pytest.raises(ConfigError, match="not a language model"):
        sample(cfg)


# ------------------------------------------------------------------ wandb


class Listener:
    """A TCP server on 127.0.0.1 that counts the connections made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def test_wandb_without_an_account_logs_offline_into_the_run_dir(tmp_path, monkeypatch):
    """No API key, no netrc, no WANDB_MODE: the run goes offline by itself. wandb's server
    is pointed at a local listener, which must see no connection."""
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    listener = Listener()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{listener.port}")
    try:
        metrics = run_train(tmp_path, [*SMALL, "logger=wandb", "trainer.max_epochs=2", "tags=[t1]"])
    finally:
        listener.close()
    assert listener.connections == 0
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = read_wandb_run(next(runs[0].glob("*.wandb")))
    assert records["history"] and "val/acc" in records["summary"]
    assert records["summary"]["val/acc"] == pytest.approx(metrics["val/acc"])
    run = records["run"]
    assert (run.project, run.job_type, list(run.tags)) == ("transformers_lab", "train", ["t1"])
    assert run.run_group == "vit-softmax-digits"
    assert "model/params" in records["config"]
    assert records["exit"], "the run was not finished (wandb.finish)"
    import wandb

    assert wandb.run is None


def wandb_records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` run file: a 7-byte header, then a log of
    32 KiB blocks whose chunks (7-byte header: crc, length, type) make up the records."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def item_value(item):
    import json

    oneof = item.DESCRIPTOR.oneofs[0].name if item.DESCRIPTOR.oneofs else None
    kind = item.WhichOneof(oneof) if oneof else None
    if kind and kind != "value_json":
        return getattr(item, kind)
    return json.loads(item.value_json) if item.value_json else None


def test_a_resumed_run_goes_on_in_the_same_wandb_run(tmp_path, monkeypatch):
    """Resumed from its checkpoint in another run dir, and from that one again, a run logs
    to the wandb run it began (the same id, ``resume="allow"``): one job, one run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    common = [*SMALL, "logger=wandb"]
    run_train(tmp_path, [*common, "trainer.max_epochs=1"], "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    run_train(tmp_path, [*common, "trainer.max_epochs=2", f"ckpt_path={last}"], "second")
    last = tmp_path / "second" / "checkpoints" / "last.ckpt"
    run_train(tmp_path, [*common, "trainer.max_epochs=3", f"ckpt_path={last}"], "third")
    ids = []
    for name in ("first", "second", "third"):
        (run_file,) = (tmp_path / name / "wandb").glob("offline-run-*/*.wandb")
        ids.append(written_run(run_file).run_id)
        assert (tmp_path / name / "wandb_id").read_text().strip() == ids[0]
    assert ids == [ids[0]] * 3  # each resume took a new id before
    fresh = run_train(tmp_path, [*common, "trainer.max_epochs=1"], "other")
    assert fresh and (tmp_path / "other" / "wandb_id").read_text().strip() != ids[0]


def written_run(path: Path, timeout: float = 30) -> object:
    """The run record of a ``.wandb`` file, once wandb's service process has written it
    (it writes the file on its own time: under load, after the run has returned)."""
    deadline = time.monotonic() + timeout
    while (run := read_wandb_run(path)["run"]) is None:
        assert time.monotonic() < deadline, f"{path} holds no run record after {timeout} s"
        time.sleep(0.5)
    return run


def read_wandb_run(path: Path) -> dict:
    """Run info, config keys, history rows, summary and whether the run exited."""
    out: dict = {"history": [], "summary": {}, "config": set(), "run": None, "exit": False}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
        elif kind == "config":
            out["config"] |= {item_key(item) for item in record.config.update}
        elif kind == "history":
            out["history"].append({item_key(i): item_value(i) for i in record.history.item})
        elif kind == "summary":
            out["summary"] |= {item_key(i): item_value(i) for i in record.summary.update}
        elif kind == "exit":
            out["exit"] = True
    return out


# ------------------------------------------------------------------ bad input


def test_the_run_dir_is_read_from_the_command_line_as_hydra_reads_it(monkeypatch):
    monkeypatch.setenv("TLAB_ROOT", "/root/of/runs")
    assert run_dir_folder([]) == Path("/root/of/runs/logs")
    assert run_dir_folder(["paths.root_dir=/else"]) == Path("/else/logs")
    # the last one counts; Lightning's DDP processes get it again, quoted
    argv = ["hydra.run.dir=/a/run", 'hydra.run.dir="/a/run"']
    assert run_dir_folder(argv) == Path("/a/run")
    assert run_dir_folder(["hydra.run.dir='/b/run'"]) == Path("/b/run")
    assert run_dir_folder(["hydra.run.dir=/c/${now:%H}/x"]) == Path("/c")
    assert run_dir_folder(["-m", "hydra.sweep.dir=/d"]) == Path("/d")


def test_an_unknown_group_option_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        check_overrides(["attention=fastmx"])
    options = ", ".join(sorted(p.stem for p in (CONF_DIR / "attention").glob("*.yaml")))
    assert str(err.value) == (
        f"unknown attention 'fastmx'; valid options are: {options} (conf/attention/)"
    )
    with pytest.raises(ConfigError, match="unknown experiment 'nope'; valid options are: baby"):
        check_overrides(["model=gpt", "experiment=nope"])
    check_overrides(["attention=softmax,fastmax", "attention.p=2", "+experiment=mqar"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model=vit", "data=shakespeare_char"],
            r"model=vit \(ViT\) cannot take "
            r"data=shakespeare_char.*no block_size, vocab_size; use model=gpt",
        ),
        (
            ["model=gpt", "data=digits"],
            r"model=gpt \(GPT\) cannot take data=digits.*"
            r"use model=encoder or model=vit",
        ),
        (
            ["model=gpt", "data=mqar", "model.block_size=32"],
            r"model.block_size=32 is smaller than the data's block_size=64",
        ),
        (["model=vit", "model.patch_size=3"], r"image_size=8 does not fit the patch grid"),
        (
            ["model=gpt", "data=mqar", "model.d_model=50", "model.n_head=4"],
            r"d_model=50.*n_head=4|50.*4",
        ),
        (
            ["task=recall"],  # the default model is a ViT
            r"task=recall \(LanguageModelTask\) trains GPT models, not model=vit \(ViT\): use "
            r"task=classification, or leave task= out",
        ),
        (
            ["model=gpt", "data=mqar", "task=translation"],
            r"\(TranslationTask\) trains Transformer models, not model=gpt \(GPT\): use "
            r"task=language_model or task=recall",
        ),
    ],
)
def test_a_model_that_does_not_fit_its_data_is_one_clear_error(
    overrides, message, tmp_path, data_root
):
    with pytest.raises(ConfigError, match=message):
        run_train(tmp_path, [*overrides, "logger=csv"])


def tlab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(cwd)}
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_command_line_reports_mistakes_in_one_line(tmp_path):
    """Through a real entry point's process: exit code 2 and one ``error:`` line, no
    traceback (every refusal's line, in the entry points' own process:
    tests/test_bad_inputs.py, which holds these two too)."""
    cases = [
        (["transformers_lab.train", "model=vit", "data=mqar"], "cannot take data=mqar"),
        (["transformers_lab.eval", f"ckpt_path={tmp_path}/x.ckpt"], "no checkpoint at"),
    ]
    for args, message in cases:
        proc = tlab(*args, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_default_run_learns_offline(tmp_path):
    """`tlab-train` with no arguments: ViT on digits, no download, well above chance."""
    proc = tlab(
        "transformers_lab.train", "logger=csv", "trainer.enable_progress_bar=false", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(proc.stdout.split("test/acc: ")[1].split()[0])
    assert accuracy > 0.9


def test_a_checkpoint_of_an_earlier_version_resumes_and_evaluates(tmp_path):
    """Its Block parts were ``attn`` and ``norm_attn`` (``mixer`` and ``norm_mixer`` now):
    resuming goes on from its step, and its weights are the ones evaluated."""
    limit = [*SMALL, "trainer.limit_train_batches=3", "test=false"]
    run_train(tmp_path, [*limit, "trainer.max_epochs=1"], "first")
    checkpoint = torch.load(tmp_path / "first" / "checkpoints" / "last.ckpt", weights_only=False)
    new = dict(checkpoint["state_dict"])
    old = {k.replace(".mixer.", ".attn.").replace(".norm_mixer.", ".norm_attn."): v
           for k, v in new.items()}  # fmt: skip
    assert old.keys() != new.keys() and any(".attn." in k for k in old)
    checkpoint["state_dict"] = old
    torch.save(checkpoint, tmp_path / "old.ckpt")
    from transformers_lab.run.checkpoints import load_task

    task, _ = load_task(tmp_path / "old.ckpt")
    for key, value in task.state_dict().items():
        torch.testing.assert_close(value, new[key])
    run_train(tmp_path, [*limit, "trainer.max_epochs=2", f"ckpt_path={tmp_path}/old.ckpt"], "on")
    resumed = torch.load(tmp_path / "on" / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == 6 and not any(".attn." in k for k in resumed["state_dict"])


def test_a_config_of_an_earlier_version_names_classes_where_they_were(tmp_path, caplog):
    """A ``_target_`` that moved (``transformers_lab.callbacks.ProgressBar``) is followed
    to its home, with a note that names both."""
    old = [
        *SMALL,
        "trainer.max_steps=1",
        "test=false",
        "callbacks.progress_bar._target_=transformers_lab.callbacks.ProgressBar",
        "callbacks.nonfinite_guard._target_=transformers_lab.run.safety.NonFiniteGuard",
    ]
    with caplog.at_level("WARNING", logger="transformers_lab.config"):
        metrics = run_train(tmp_path, old, "old")
    assert "val/loss" in metrics
    said = caplog.text
    assert "transformers_lab.callbacks.ProgressBar moved to " in said
    assert "transformers_lab.run.callbacks.views.ProgressBar; update your config" in said
    assert "transformers_lab.run.safety.NonFiniteGuard moved to" in said
