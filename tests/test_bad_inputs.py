"""Bad input through the real entry points (run in process, offline): every case ends in
exit code 2 and one ``error:`` line on stderr that names the mistake, with no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
import torch

from transformers_lab.bench.generation import main as bench_generation_main
from transformers_lab.bench.kernels import main as bench_kernels_main
from transformers_lab.bench.long_context import main as bench_long_context_main
from transformers_lab.check import main as check_main
from transformers_lab.config import compose_config
from transformers_lab.data import download
from transformers_lab.eval import main as eval_main
from transformers_lab.export import main as export_main
from transformers_lab.run.fit import train
from transformers_lab.sample import main as sample_main
from transformers_lab.train import main as train_main

ENTRY_POINTS = {
    "train": train_main,  # from SMALL's ViT
    "train-bare": train_main,  # without SMALL (a model it does not fit)
    "eval": eval_main,
    "sample": sample_main,
    "export": export_main,
    # the tools that name a kernel as the attention group does (attention/resolve.py)
    "check": lambda: sys.exit(check_main()),
    "bench": lambda: sys.exit(bench_kernels_main()),
    "bench-generation": lambda: sys.exit(bench_generation_main()),
    "bench-long-context": lambda: sys.exit(bench_long_context_main()),
}
# a ViT on digits that trains in a second (every train case starts from it)
SMALL = [
    "logger=csv",
    "model.d_model=32",
    "model.n_layer=1",
    "model.n_head=2",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
MQAR = ["data=mqar", "data.train_examples=8", "data.val_examples=8"]
REAL = Path(os.environ.get("TLAB_DATA_DIR", "/nonexistent"))  # real data sets, if there
NEEDS_MNIST = pytest.mark.skipif(
    not (REAL / "MNIST" / "raw").is_dir(), reason=f"needs the real MNIST under TLAB_DATA_DIR={REAL}"
)


# the refusal of a checkpoint whose unpickling would call a function of its own choosing
PLANTED = "planted.ckpt asks to run exec as it loads (it holds more than tensors"


class Planted:
    """Pickled, a call of ``exec`` that writes ``path``: what a crafted checkpoint does."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('ran')",)


def case(entry: str, args: list[str], message: str, **options) -> pytest.param:
    """``tlab-<entry> <args>`` must fail with ``message`` in its error line. ``{name}`` in
    an argument or the message is a file of the ``files`` fixture; ``$NAME=value`` sets an
    env var."""
    return pytest.param(entry, args, message, id=f"{entry} {' '.join(args)}", **options)


CASES = [
    # a kernel named to the check and the benches: unknown, or a config dir without kernels
    case("check", ["relu3"], "unknown kernel 'relu3' (did you mean relu?); valid: additive"),
    case("check", ["relu2", "--config-dir", "{tmp}"], "no attention/ folder in the config dir"),
    case("check", ["my_conf/attention/none.yaml"], "no kernel config at my_conf/attention/none"),
    case("bench", ["--kernels", "softmax", "relu3"], "unknown variant(s) 'relu3'; valid variants"),
    case("bench-generation", ["--kernels", "relu3"], "unknown variant(s) 'relu3'"),
    case("bench-long-context", ["--kernels", "relu3"], "unknown kernel 'relu3'; valid: additive"),
    case("bench", ["--config-dir", "{tmp}"], "no attention/ folder in the config dir"),
    case("bench", ["--kernels", "gla_fla"], "gla_fla: the fused backends are timed on --device"),
    case("bench", ["--in-process"], "--in-process measures on --device cuda only"),
    case("check", ["gla", "--device", "tpu9"], "--device 'tpu9' is not a device; use cpu or cuda"),
    # the model and its attention kernel
    case("train", ["attention=fastmx"], "unknown attention 'fastmx'; valid options are"),
    case("train", ["model.attention=fastmx"], "unknown attention kernel 'fastmx'; valid kernels"),
    case("train", ["attention=fastmax", "attention.p=3"], "unsupported Taylor order p=3"),
    # attention.backend: one that cannot run here, one that does not cover the kernel
    case(
        "train",
        ["attention=fastmax", "attention.backend=fla"],
        "fastmax: attention.backend=fla cannot run on this machine: no CUDA GPU is visible",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here"),
    ),
    case(
        "train",
        ["attention=softmax", "+attention.backend=fla"],
        "softmax: attention.backend=fla is not a fused kernel for softmax (no fused kernel covers",
    ),
    case(
        "train",
        ["attention=linear", "attention.backend=flex"],
        "linear: attention.backend=flex is not a fused kernel for linear (it takes auto, loop, fla",
    ),
    # scaling out (docs/training.md, Scaling out)
    case(
        "train-bare",
        ["experiment=baby_gpt", "trainer.max_tokens=100"],
        "trainer.max_tokens=100 is below one optimizer step of 768 tokens",
    ),
    case(
        "train-bare",
        ["experiment=baby_gpt", "trainer.batch_tokens=1000"],
        "trainer.batch_tokens=1,000 is no whole number of micro-batches: one is data.batch_size",
    ),
    case(
        "train",
        ["trainer=fsdp_cpu", "trainer.devices=1"],
        "trainer=fsdp shards the model over processes, and this run has 1: give trainer.devices",
    ),
    case(
        "train",
        ["callbacks.throughput.hardware=A9000"],
        "hardware='A9000' is not in the table of peaks (B200, H200",
    ),
    case("train", ["model.dropout=-0.1"], "model.dropout must be a number in [0, 1), got -0.1"),
    case("train", ["attention.dropout=1.5"], "attention: dropout must be in [0, 1), got 1.5"),
    case("train", ["model.d_model=33"], "d_model=33 must be divisible by n_head=2"),
    case("train", ["model.n_head=0"], "model.n_head must be an integer >= 1, got 0"),
    case("train", ["model.n_layer=0"], "model.n_layer must be an integer >= 1, got 0"),
    case("train", ["model.mlp_ratio=abc"], "model.mlp_ratio must be a number (ViT takes mlp_ratio"),
    case("train", ["model.mlp_ratio=-1"], "model.mlp_ratio must be a number >= 0 (0: no MLP)"),
    case("train", ["model.patch_size=0"], "model.patch_size must be an integer >= 1, got 0"),
    case(
        "train",
        ["attention=fastmax_p1", "attention.normalize=false"],
        "fastmax p=1 gives negative attention weights",
    ),
    case("train", ["attention=cosine", "attention.init_tau=0"], "cosine: need 0 < init_tau"),
    case("train", ["attention=additive", "attention.attn_dim=0"], "attn_dim must be positive"),
    # the layer around the kernel (nn/parts.py), the window, hybrid stacks
    case("train", ["attention.short_conv=-1"], "attention.short_conv must be an integer >= 0"),
    case("train", ["attention.short_conv=1.5"], "attention.short_conv must be an integer >= 0"),
    case("train", ["attention=sliding_window", "attention.window=0"], "window must be a positive"),
    case(
        "train",
        ["model=gpt", *MQAR, "model.n_layer=2", "model.hybrid=[softmax,relu3]"],
        "model.hybrid: unknown layer 'relu3'; valid ones are: attention, additive",
    ),
    case(
        "train",
        ["model=gpt", *MQAR, "model.n_layer=2", "model.hybrid=[softmax,dot,softmax]"],
        "model.hybrid has 3 entries, which does not divide n_layer=2",
    ),
    case(
        "train",
        [
            "model=gpt",
            *MQAR,
            "model.n_layer=2",
            "model.pos_encoding=alibi",
            "model.hybrid=[softmax,fastmax]",
        ],
        "model.hybrid, layer 1 (fastmax): pos_encoding=alibi adds a bias",
    ),
    case("check", ["softmax", "short_conv=-2"], "attention.short_conv must be an integer >= 0"),
    # a sweep's summary: a misspelt key was ignored (every rate kept), after the whole sweep
    case(
        "train",
        ["summary.best_over=[optimizer.lrr]"],
        "summary.best_over: optimizer.lrr is no key of the config (did you mean optimizer.lr?)",
    ),
    case("train", ["summary.mean_over=[dta]"], "summary.mean_over: dta is no key of the config"),
    # a key where a list of keys is meant: it was read letter by letter, after every job
    case(
        "train",
        ["-m", "seed=0,1", "summary.best_over=optimizer.lr"],
        "summary.best_over is a list of keys, got 'optimizer.lr'; write it in brackets: "
        "summary.best_over=[optimizer.lr] (job 0: ",
    ),
    case("train", ["summary.mean_over=data"], "summary.mean_over is a list of keys, got 'data'"),
    # a sweep's value refused before any of its jobs runs, naming the job
    case(
        "train",
        ["-m", "optimizer.lr=1e-3,-1"],
        "optimizer.lr must be a number > 0, got -1 (job 1: ",
    ),
    # a launcher: given to one run (it was ignored), or with options that run nothing
    case("train", ["launcher=joblib"], "launcher=joblib launches the jobs of a multirun"),
    case(
        "train",
        ["-m", "seed=0,1", "launcher=joblib", "hydra.launcher.n_jobs=0"],
        "hydra.launcher.n_jobs=0 runs no job: give how many jobs run at once",
    ),
    case(
        "train",
        ["-m", "seed=0,1", "launcher=slurm", "hydra.launcher.timeout_min=1"],
        "hydra.launcher.signal_delay_s=120 must be a number of seconds above 0 and at most "
        "the time limit (1 min) less a minute",
    ),
    case(
        "train",
        ["-m", "seed=0,1", "launcher=slurm", "hydra.launcher.timeout_min=soon"],
        "hydra.launcher.timeout_min='soon' is no time limit",
    ),
    # lengths and depths past the trained length: every wrong value named; a scalar
    case("train", ["eval_lengths=[0,-5]"], "each length must be an integer >= 1; 0 and -5 are"),
    case(
        "train",
        ["eval_lengths=[64]", "eval_depths=0.5"],
        "eval_depths=0.5 is not a list: write the depths in brackets, e.g. eval_depths=[0.5]",
    ),
    case("eval", ["ckpt_path={vit}", "seed=-1"], "seed must be an integer >= 0, got -1"),
    # the model against its data
    case(
        "train",
        ["model=gpt", *MQAR, "model.block_size=32"],
        "model.block_size=32 is smaller than the data's block_size=64",
    ),
    case("train", ["model.patch_size=3"], "image_size=8 does not fit the patch grid"),
    case("train", ["model=vit", *MQAR], "model=vit (ViT) cannot take data=mqar"),
    # refusals the model's constructors own, met before the data is read (preflight
    # builds the layers on the meta device through the models' own rules)
    case(
        "train",
        ["model=gpt", *MQAR, "attention=cosformer", "attention.max_len=8"],
        "cosformer weighs positions up to its max_len=8, but the GPT's context is",
    ),
    case(
        "train-bare",
        ["experiment=transformer_multi30k", "attention=cosformer"],
        "attention: attention=cosformer weighs keys by their positions in one sequence",
    ),
    case(
        "train-bare",
        ["experiment=transformer_multi30k", "attention=deltanet"],
        "attention: the Transformer's encoder attends both ways: attention=deltanet reads",
    ),
    case("train", ["model=gpt", "data=digits"], "cannot take data=digits"),
    # data
    case(
        "train",
        ["data.batch_size=0"],
        "refuses data.batch_size=0: batch_size must be an integer >= 1",
    ),
    case(
        "train",
        ["data.val_fraction=1.5"],
        "val_fraction=1.5 must be in (0, 1)",
    ),
    case("train", ["data=mnist", "data.download=false"], "is missing and downloads are off"),
    # offline: no network
    case("train", ["model=gpt", "data=shakespeare_char"], "could not download"),
    # checkpoints to resume from
    case(
        "train",
        ["model=gpt", *MQAR, "ckpt_path={vit}"],
        "was trained with another config: data._target_: "
        "'transformers_lab.data.DigitsDataModule' -> 'transformers_lab.data.SyntheticDataModule'; "
        "model._target_: 'transformers_lab.models.ViT' -> 'transformers_lab.models.GPT'; "
        "task._target_: 'transformers_lab.tasks.ClassificationTask' -> "
        "'transformers_lab.tasks.LanguageModelTask'; resume with",
    ),
    case(
        "train",
        ["model.d_model=48", "ckpt_path={vit}"],
        "was trained with another config: model.d_model: 32 -> 48; resume with",
    ),
    case(  # a tensor-shape check only, for a checkpoint with no saved config
        "train",
        ["ckpt_path={plain}"],
        "was saved from a different model config (",
    ),
    case(
        "train",
        ["ckpt_path={vit}", "optimizer.lr=0.01", "resume_may_change=[optimizer.lr]"],
        "resume_may_change: optimizer.lr names no key of the model, data or task config that "
        "the checkpoint is compared with (did you mean task.optimizer.lr?)",
    ),
    case("train", ["ckpt_path={tmp}/nope.ckpt"], "no checkpoint at"),
    case("train", ["ckpt_path={junk}"], "junk.ckpt is not a checkpoint"),
    # a checkpoint whose pickle would run code (it writes the file {ran}): none runs
    case("train", ["ckpt_path={planted}"], PLANTED),
    # where the run goes
    case("train", ["$TLAB_ROOT={file}"], "cannot create the run dir in"),
    case("train", ["hydra.run.dir={file}/run"], "(Not a directory)"),
    case(
        "train",
        ["paths.root_dir={locked}"],
        "(Permission denied)",
        marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder"),
    ),
    case(  # a folder that even root cannot write in
        "train",
        ["paths.root_dir=/sys/tlab"],
        "cannot create the run dir in /sys/tlab/logs: /sys is not a folder that can be written",
        marks=pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's /sys"),
    ),
    # optimizer, schedule, trainer
    case("train", ["optimizer.lr=0"], "optimizer.lr must be a number > 0, got 0"),
    case("train", ["optimizer.betas=[0.9,1.5]"], "optimizer.betas must be two numbers in [0, 1)"),
    case("train", ["scheduler.warmup_steps=-5"], "scheduler.warmup_steps must be an integer >= 0"),
    case("train", ["trainer.max_epochs=0"], "trainer.max_epochs must be null or -1 (no limit)"),
    case("train", ["trainer.max_epochs=-1", "trainer.max_steps=-1"], "never stops"),
    case("train", ["trainer.gradient_clip_val=-1"], "gradient_clip_val must be null or a number"),
    case("train", ["trainer.accumulate_grad_batches=0"], "accumulate_grad_batches must be an"),
    case("train", ["trainer.precision=fp8"], "trainer.precision must be one of"),
    case("train", ["trainer.limit_train_batches=1.5"], "limit_train_batches must be null or a"),
    case("train", ["trainer=tpu"], "unknown trainer 'tpu'"),
    case(
        "train",
        ["trainer=gpu"],
        "trainer.accelerator=gpu needs a GPU, and torch finds none on this machine (cuda or "
        "mps); use trainer=cpu to train on the CPU",
        marks=pytest.mark.skipif(
            torch.cuda.is_available() or torch.backends.mps.is_available(),
            reason="needs a machine without a GPU",
        ),
    ),
    case("train", ["monitor.mode=up"], "monitor.mode must be one of min, max, got 'up'"),
    case(
        "train",
        ["trainer.limit_train_batches=0"],
        "the run has no optimizer step to schedule (trainer.limit_train_batches=0",
    ),
    case("train", ["trainer.accelerator=tpu"], "trainer: Requirement 'torch_xla"),
    # sizes a data module refuses, and the file system
    case(
        "train",
        ["model=gpt", *MQAR, "data.block_size=4"],
        "data=mqar (SyntheticDataModule) refuses data.block_size=4, data.num_kv_pairs=8: "
        "block_size=4 is too short for num_kv_pairs=8: MQAR needs block_size >= 4 * ",
    ),
    # a needle that does not fit its context, a depth outside [0, 1]
    case(
        "train",
        ["model=gpt", "data=passkey", "task=recall", "data.block_size=64"],
        "data=passkey (NeedleDataModule) refuses data.block_size=64, data.digits=5: "
        "block_size=64 is too short for passkey: its needle, question and answer take up to "
        "103 characters",
    ),
    case(
        "train",
        ["model=gpt", "data=passkey", "task=recall", "data.depth=1.5"],
        "data=passkey (NeedleDataModule) refuses data.depth=1.5: depth must be in [0, 1]",
    ),
    # LRA's generated tasks: a ListOps depth or length out of range, a Pathfinder image
    # that is not a square, a pixel task longer than the model's context
    case(
        "train",
        ["experiment=lra_listops", "data.max_depth=0"],
        "data=lra_listops (ListOpsDataModule) refuses data.max_depth=0: max_depth must be an "
        "integer >= 1, got 0",
    ),
    case(
        "train",
        ["experiment=lra_listops", "data.min_length=600"],
        "data=lra_listops (ListOpsDataModule) refuses data.min_length=600, data.max_length=500:"
        " max_length=500 must exceed min_length=600 + 1",
    ),
    case(
        "train",
        ["experiment=lra_listops", "data.max_depth=3", "data.max_args=3"],
        "min_length=100 is out of reach: trees of max_depth=3 and max_args=3 are at most 17 "
        "tokens long",
    ),
    case(
        "train",
        ["experiment=lra_pathfinder", "data.block_size=1000"],
        "data=lra_pathfinder (PathfinderDataModule) refuses data.block_size=1000: "
        "block_size=1000 is not a square: Pathfinder reads a square image row by row",
    ),
    case(
        "train",
        ["experiment=pixel_mnist", "model.block_size=128", "$TLAB_DATA_DIR={real}"],
        "model.block_size=128 is smaller than the data's block_size=196",
        marks=NEEDS_MNIST,
    ),
    case(
        "train",
        ["model=vit", "data=mnist", "data.as_sequence=true", "$TLAB_DATA_DIR={real}"],
        "model=vit (ViT) cannot take data=mnist: the data provides block_size, num_classes, "
        "vocab_size but ViT has no block_size, vocab_size; use model=encoder",
        marks=NEEDS_MNIST,
    ),
    case(
        "train",
        ["model=encoder", "data.as_sequence=true", "data.pixel_side=12"],
        "data=digits (DigitsDataModule) refuses data.pixel_side=12: "
        "pixel_side=12 must be between 1 and the image's side 8",
    ),
    case(
        "train",
        ["data.val_fraction=0.9", "data.test_fraction=0.5"],
        "data=digits (DigitsDataModule) refuses data.val_fraction=0.9, data.test_fraction=0.5: "
        "val_fraction=0.9 + test_fraction=0.5 leave no training images",
    ),
    # values a data module refuses itself: its constructor, or its set-up
    case(
        "train",
        ["data=shakespeare_bpe", "data.encoding=nonsense"],
        "data=shakespeare_bpe (ShakespeareBPEDataModule) refuses data.encoding='nonsense': "
        "unknown tiktoken encoding 'nonsense'; known ones: ",
    ),
    case(
        "train",
        ["data=multi30k", "data.tokenizer=tiktoken", "data.encoding=nonsense"],
        "data=multi30k (TranslationDataModule) refuses data.encoding='nonsense': unknown "
        "tiktoken encoding 'nonsense'",
    ),
    case(
        "train",
        [*MQAR, "data.problem=sorting"],
        "data=mqar (SyntheticDataModule) refuses data.problem='sorting': unknown synthetic "
        "problem 'sorting'; valid ones are: mqar, copy, sort",
    ),
    case(
        "train",
        ["data=mad_in_context_recall", "+data.k_motif_size=3"],
        "data=mad_in_context_recall (MADDataModule) refuses data.k_motif_size=3: MAD's "
        "in_context_recall takes no k_motif_size",
    ),
    case(  # refused as the tokenizer is built, when the data is set up
        "train",
        ["model=gpt", "data=shakespeare_bpe", "data.bpe_file={junk}", "$TLAB_DATA_DIR={real}"],
        "data=shakespeare_bpe (ShakespeareBPEDataModule) refuses data.bpe_file='{junk}': "
        "bpe_file={junk} is not a .tiktoken ranks file",
        marks=pytest.mark.skipif(
            not (REAL / "shakespeare" / "input.txt").is_file(),
            reason=f"needs the real Tiny Shakespeare under TLAB_DATA_DIR={REAL}",
        ),
    ),
    # a corpus of the user's: no sources, a glob that matches nothing, a file of no format
    case("train", ["model=gpt", "data=corpus"], "data=corpus needs data.sources (files, globs"),
    case(
        "train",
        ["model=gpt", "data=corpus", "data.sources=[{tmp}/none*.txt]", "data.tokenizer=char"],
        "data.sources: '{tmp}/none*.txt' matches no file; give an existing file, folder or glob",
    ),
    case(
        "train",
        ["model=gpt", "data=corpus", "data.sources=[{file}]", "data.tokenizer=char"],
        "data.sources: cannot tell the format of {file} from its suffix; name it .txt",
    ),
    case(
        "train",
        ["data=mnist", "$TLAB_DATA_DIR=/proc/tlab"],
        "cannot create /proc/tlab/MNIST/raw to download https://",
        marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc"),
    ),
    case(
        "train",
        ["callbacks.model_checkpoint.dirpath=/proc/tlab/ckpt"],
        "cannot use /proc/tlab: No such file or directory; check that the path exists",
        marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc"),
    ),
    case(  # found after the sanity check, before training
        "train",
        ["monitor.metric=val/accuracy"],
        "monitor.metric=val/accuracy is not a metric this run logs (it logs: val/acc, val/loss)",
    ),
    case(  # a training metric: found at the first save
        "train",
        ["monitor.metric=train/los", "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0"],
        "monitor.metric=train/los is not a metric this run logs (it logs: ",
    ),
    # loggers, callbacks, presets
    case("train", ["logger=nope"], "unknown logger 'nope'; valid options are: csv,"),
    case("train", ["logger=[csv,nope]"], "unknown logger 'nope'"),
    case("train", ["+logger.nope.save_dir=x"], "unknown logger 'nope'"),
    case("train", ["callbacks=nope"], "unknown callbacks 'nope'"),
    case("train", ["experiment=nope"], "unknown experiment 'nope'"),
    # the command line itself
    case("train", ["model.dropuot=0.1"], "unknown key model.dropuot (did you mean model.dropout?)"),
    case("train", ["model=transformer"], "unknown key model.n_layer (did you mean model.n_enc"),
    case("train", ["model.d_model=[1"], "no viable alternative at input '[1'"),
    case(  # argparse printed its usage
        "train",
        ["--max_steps", "100"],
        "unknown option --max_steps: settings are Hydra overrides key=value, not --options; "
        "write trainer.max_steps=100 or scheduler.max_steps=100",
    ),
    case("train", ["--nope"], "unknown option --nope: settings are Hydra overrides key=value"),
    case(  # a misspelled group: +atention=... would have been wrong advice
        "train",
        ["atention=fastmax"],
        "unknown key atention (did you mean the config group attention? attention=<option>, "
        "one of: additive, ",
    ),
    case("train", ["data.batch_size=${nope}"], "Interpolation key 'nope' not found"),
    case(
        "train",
        ["experiment=mqar", "model.pos_encoding=rope", "model.d_model=66", "model.n_head=6"],
        "rope needs an even head dim (the query/key width of a head: d_model / n_head",
    ),
    case(
        "train",
        ["experiment=mqar", "model.pos_encoding=alibi", "attention=performer"],
        "attention: pos_encoding=alibi adds a bias to the attention scores, which "
        "attention=performer never forms",
    ),
    case(  # a decay kernel: the decay is its distance bias
        "train",
        ["experiment=mqar", "model.pos_encoding=alibi", "attention=retnet"],
        "attention: pos_encoding=alibi adds a bias to the attention scores, which "
        "attention=retnet never forms",
    ),
    case(
        "train",
        ["experiment=mqar", "model.pos_encoding=alibi", "attention=gla"],
        "which attention=gla never forms",
    ),
    case(  # fla's Triton kernels: CUDA only (CI has none: the refusal is what it sees)
        "train",
        ["experiment=mqar", "attention=gla", "attention.backend=fla"],
        "gla: attention.backend=fla cannot run on this machine: no CUDA GPU is visible",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible"),
    ),
    case(
        "train",
        ["experiment=mqar", "attention=deltanet", "attention.backend=cuda"],
        "deltanet: unknown attention.backend='cuda'; deltanet takes one of auto, loop, fla",
    ),
    case(
        "train",
        ["experiment=mqar", "attention=deltanet", "attention.backend=triton"],
        "deltanet: attention.backend=triton is not a fused kernel for deltanet (it takes auto, "
        "loop, fla); use attention.backend=auto",
    ),
    case(
        "train",
        ["experiment=mqar", "attention=fastmax", "attention.backend=triton"],
        "fastmax: attention.backend=triton cannot run on this machine: no CUDA GPU is visible "
        "(the fused kernel is a Triton kernel for CUDA); use attention.backend=auto (our loop "
        "here)",
    ),
    case(
        "train",
        ["experiment=mqar", "attention=retnet", "attention.gamma=[0.9,1.5]"],
        "retnet: gamma must be one decay in (0, 1], or one per head (2), got [0.9, 1.5]",
    ),
    case(
        "train",
        ["experiment=mqar", "attention=retnet", "attention.gamma=1.5"],
        "retnet: gamma must be one decay in (0, 1], or one per head (2), got 1.5",
    ),
    case(
        "train",
        ["model=vit", "data=digits", "attention=deltanet"],
        "the ViT attends both ways: attention=deltanet reads the sequence in order",
    ),
    case(  # KDA: fla's chunk_kda, CUDA only
        "train",
        ["experiment=mqar", "attention=kda", "attention.backend=fla"],
        "kda: attention.backend=fla cannot run on this machine: no CUDA GPU is visible",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible"),
    ),
    case(
        "train",
        ["model=vit", "data=digits", "attention=kda"],
        "the ViT attends both ways: attention=kda reads the sequence in order",
    ),
    case(  # RWKV-7's bottlenecks
        "train",
        ["experiment=mqar", "attention=rwkv7", "attention.gate_rank=0"],
        "rwkv7: gate_rank must be an integer >= 1, got 0",
    ),
    case(  # Gated DeltaProduct's n_h keys a token
        "train",
        ["experiment=mqar", "attention=gated_deltaproduct", "attention.householder=0"],
        "gated_deltaproduct: householder must be an integer >= 1 (the keys a token), got 0",
    ),
    case(
        "train",
        ["model=vit", "data=digits", "attention=fox"],
        "the ViT attends both ways: attention=fox decays each score by the forget gates",
    ),
    case(  # the authors' normalisation reads the whole sequence: no causal model takes it
        "train",
        ["experiment=mqar", "attention=fastmax", "attention.normalize=sequence_max"],
        "attention: the GPT attends causally: fastmax normalize=sequence_max divides every token",
    ),
    # tlab-eval
    case("eval", [], "ckpt_path is required"),
    case("eval", ["ckpt_path={tmp}/nope.ckpt"], "no checkpoint at"),
    case("eval", ["ckpt_path={plain}"], "holds no tlab_config"),
    case("eval", ["ckpt_path={planted}"], PLANTED),
    case("eval", ["ckpt_path={vit}", "split=train"], "split=train is not one of val, test"),
    case("eval", ["ckpt_path={vit}", "+data.batch_size=0"], "batch_size must be an integer >= 1"),
    case("eval", ["ckpt_path={vit}", "logger=nope"], "unknown logger 'nope'"),
    case(  # the checkpoint's data config, which no option of tlab-eval's chose
        "eval",
        ["ckpt_path={vit}", "+data.val_fraction=0.9", "+data.test_fraction=0.5"],
        "data (DigitsDataModule) refuses data.val_fraction=0.9, data.test_fraction=0.5: ",
    ),
    # tlab-eval at other lengths: one a model cannot reach, a needle that does not fit, a
    # depth outside [0, 1], data of no length
    case(
        "eval",
        ["ckpt_path={passkey}", "eval_lengths=[128,512]"],
        "cannot evaluate {passkey} at length 512: its learned positions end at block_size=128",
    ),
    case(
        "eval",
        ["ckpt_path={passkey}", "eval_lengths=[64]"],
        "at length 64: data (NeedleDataModule) refuses data.block_size=64, data.digits=5: "
        "block_size=64 is too short for passkey",
    ),
    case(
        "eval",
        ["ckpt_path={passkey}", "eval_lengths=[128]", "eval_depths=[0,2]"],
        "eval_depths: each depth must be a number in [0, 1] (0: the haystack's start, 1: its "
        "end); 2 is not",
    ),
    case("eval", ["ckpt_path={vit}", "eval_lengths=[64]"], "scores a GPT (language model"),
    case(
        "eval",
        ["ckpt_path={passkey}", "eval_lengths=[128]", "split=test"],
        "NeedleDataModule has no test split; use split=val",
    ),
    case(
        "eval",
        ["ckpt_path={passkey}", "harness.tasks=[piqa]"],
        "was trained on NeedleDataModule, which has no text tokenizer: the harness takes",
    ),
    case(
        "eval",
        ["ckpt_path={passkey}", "harness.tasks=[piqa]", "eval_lengths=[128]"],
        "harness.tasks and eval_lengths are two evaluations",
    ),
    # tlab-export
    case("export", ["ckpt_path={vit}", "out={tmp}/x"], "holds a ViT, not a language model"),
    case("export", ["ckpt_path={vit}", "out={full}"], "exists and is not empty; give a new"),
    # tlab-sample
    case("sample", ["ckpt_path={vit}"], "holds a ViT, not a language model: tlab-sample"),
    case("sample", ["ckpt_path={junk}"], "is not a checkpoint"),
    case("sample", ["ckpt_path={planted}"], PLANTED),
    case("sample", ["ckpt_path={vit}", "temperature=-1"], "temperature must be >= 0, got -1"),
    case("sample", ["ckpt_path={vit}", "top_p=1.5"], "top_p must be in (0, 1], got 1.5"),
    case("sample", ["ckpt_path={vit}", "num_samples=0"], "num_samples must be an integer >= 1"),
    case("sample", ["ckpt_path={vit}", "cpu_threads=0"], "cpu_threads must be null or an integer"),
    case("sample", ["ckpt_path={vit}", "device=nope"], "device must be cpu or a GPU"),
    case("sample", ["ckpt_path={vit}", "--prompt", "hi"], "write prompt=hi"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Checkpoints of a small ViT on digits and a GPT on passkeys (one training batch
    each), and files that are not what they are given for."""
    root = tmp_path_factory.mktemp("files")
    one_batch = [
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0",
        "test=false",
    ]
    train(compose_config("train", [*SMALL, *one_batch], root / "vit"))
    passkey = ["model=gpt", "data=passkey", "task=recall", "data.block_size=128"]
    passkey += ["data.train_examples=8", "data.val_examples=8", "data.batch_size=8"]
    passkey += ["model.n_layer=1", "model.d_model=16", "model.n_head=2"]
    train(compose_config("train", [*SMALL, *one_batch, *passkey], root / "passkey"))
    (root / "junk.ckpt").write_text("not a checkpoint")
    torch.save({"state_dict": {}}, root / "plain.ckpt")
    torch.save({"state_dict": {}, "x": Planted(root / "ran")}, root / "planted.ckpt")
    (root / "file").write_text("a file where a folder should be")
    (root / "empty").mkdir()
    (root / "full").mkdir()
    (root / "full" / "mine.txt").write_text("a folder that holds a file")
    (root / "locked").mkdir(mode=0o500)
    names = ("junk.ckpt", "plain.ckpt", "planted.ckpt", "ran", "file", "empty", "full", "locked")
    paths = {name.split(".")[0]: str(root / name) for name in names}
    paths |= {run: str(root / run / "checkpoints" / "last.ckpt") for run in ("vit", "passkey")}
    return {"real": str(REAL), **paths}


def offline(url: str, path, timeout: float = 60.0) -> None:
    raise urllib.error.URLError("no network in the tests")


@pytest.mark.parametrize(("entry", "args", "message"), CASES)
def test_bad_input_is_one_error_line_and_exit_code_2(
    entry, args, message, files, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    monkeypatch.setenv("TLAB_DATA_DIR", files["empty"])
    monkeypatch.setattr(download, "fetch", offline)
    overrides = SMALL.copy() if entry == "train" else []
    for arg in args:
        arg = arg.format(**files, tmp=tmp_path) if "${" not in arg else arg
        if arg.startswith("$"):
            monkeypatch.setenv(*arg[1:].split("=", 1))
        else:
            overrides.append(arg)
    overrides.sort(key=lambda arg: arg != "-m")  # Hydra's flag before the overrides
    monkeypatch.setattr(sys, "argv", [f"tlab-{entry}", *overrides])
    with pytest.raises(SystemExit) as exit_:
        ENTRY_POINTS[entry]()
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_.value.code == 2, err
    assert len(errors) == 1 and message.format(**files, tmp=tmp_path) in errors[0], err
    assert "Traceback" not in err
    assert not Path(files["ran"]).exists(), "a checkpoint's pickle ran code"
    left = [str(p) for p in (tmp_path / "logs").glob("*/*/*")]  # logs/<task>/runs/<run>
    if "/proc/" not in " ".join(args):  # the machine's refusal (OSError): the run is kept
        assert not left, f"a refused run left its dir: {left}"


@pytest.mark.parametrize(("entry", "args", "message"), [
    ("train", ["optimizer.lr=-1"], "optimizer.lr must be a number > 0, got -1"),
    ("train", ["-m", "seed=0,1", "trainer.max_steps=0"], "trainer.max_steps must be -1"),
    ("eval", ["ckpt_path=x.ckpt", "trainer.precision=8"], "trainer.precision must be one of"),
    ("sample", ["ckpt_path=.", "num_samples=0"], "num_samples must be an integer >= 1"),
    ("sample", ["ckpt_path=x.ckpt"], "no checkpoint at x.ckpt; give ckpt_path="),
    ("translate", ["ckpt_path=x.ckpt"], "no checkpoint at x.ckpt; give ckpt_path="),
    ("translate", ["ckpt_path=.", "decode=bogus"], "unknown decode=bogus"),
    ("translate", ["ckpt_path=.", "text=a", "input_file=b"], "give text=... or input_file=..."),
    ("prepare", ["data=mnist"], "prepares a corpus (data=corpus), not MNISTDataModule"),
])  # fmt: skip
def test_a_mistake_in_a_value_is_refused_before_torch_is_imported(entry, args, message, tmp_path):
    """What needs no constructor is refused before torch and Lightning are imported (about
    a second, where importing them takes 6 s or more), and leaves no run dir."""
    code = (
        f"import sys\nsys.argv = ['tlab-{entry}', *{args!r}]\n"
        f"from transformers_lab.{entry} import main\n"
        "try:\n    main()\nexcept SystemExit as exc:\n"
        "    print(exc.code, sorted(m for m in ('torch', 'lightning') if m in sys.modules))\n"
    )
    env = {**os.environ, "TLAB_ROOT": str(tmp_path), "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.stdout.strip().splitlines()[-1] == "2 []", proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "logs").glob("*/*/*")), "a refused run left its dir"


def test_a_model_that_cannot_take_the_data_is_refused_before_the_data_is_drawn(
    monkeypatch, tmp_path, capsys
):
    """At LRA's own sizes, drawing ListOps takes minutes: the model is held to the sizes
    the data will give before any of it is drawn."""
    from transformers_lab.data.lra import LRADataModule

    def drawn(self):
        raise AssertionError("the data was drawn before the model was refused")

    monkeypatch.setattr(LRADataModule, "generate", drawn)
    monkeypatch.setenv("TLAB_ROOT", str(tmp_path))
    for model in ("gpt", "vit"):
        monkeypatch.setattr(sys, "argv", ["tlab-train", f"model={model}", "data=lra_listops"])
        with pytest.raises(SystemExit) as exit_:
            train_main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"model={model}" in err, err
        assert "cannot take data=lra_listops" in err and "use model=encoder" in err
