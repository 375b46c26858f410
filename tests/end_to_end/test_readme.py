"""Every command line of the README and of docs/ runs as written, at a tiny budget.

The commands are the ``tlab-*`` and ``python -m transformers_lab...`` lines of their bash
blocks (an environment prefix such as ``PYTHONPATH=tests/user`` included); a ``make``
line must name a target of the Makefile. Its placeholders (``<time>``,
``.../last.ckpt``, ``<sweep A>``) are filled in with runs trained here first: the default
ViT, a baby GPT on Tiny Shakespeare, a GPT with RoPE on passkeys, the Multi30k Transformer
and two small MQAR sweeps.
Each command gets the budget its row of ``BUDGET`` gives and must exit 0: ``debug=limit``
(3 epochs of 3 batches, checkpoints included), or ``debug=fdr`` (one batch of each split)
for the 40-odd single runs of MQAR, Zoology and MAD that differ only in their kernel, its
options and the task. It runs in a process of its own, with its own arguments, directory,
environment and files, forked from one that has imported torch, Lightning and Hydra once
(``forked.py``): 2 seconds a tiny run rather than 9. Two kinds of line run cheaper: a
sweep's ``launcher=joblib`` is dropped (``IN_PROCESS``: its jobs run in the command's own
process), and the kernel bench's lines after its first are checked by the bench's parser.
``SKIPPED`` lists the lines left out, each with its reason; a line of the README is in one
or the other, or the test that reads them fails.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import shlex
from pathlib import Path

import pytest

from tests.end_to_end.forked import Commands, Done

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # the README and every docs/ page
DATA = os.environ.get("TLAB_DATA_DIR")

NO_GPU = "needs GPUs, which CI does not have"
SKIPPED = {
    "tlab-train experiment=vit_mnist trainer=gpu": NO_GPU,
    "tlab-train trainer=ddp trainer.devices=4 experiment=gpt_shakespeare": NO_GPU,
    "tlab-train trainer=ddp trainer.devices=8 trainer.num_nodes=2 ...": NO_GPU
    + "; and several nodes",
    "tlab-train trainer=fsdp trainer.devices=4 experiment=gpt_shakespeare": NO_GPU,
    "tlab-train trainer=gpu trainer.precision=bf16-mixed compile=true": NO_GPU,
    "tlab-train experiment=baby_gpt attention=fastmax_p2 attention.backend=triton": NO_GPU
    + " (tests/attention/test_triton_fastmax.py runs the kernel under Triton's interpreter)",
    "tlab-check gla --device cuda": NO_GPU
    + " (tests/gpu runs it for every kernel on a GPU machine)",
    "tlab-train -m launcher=slurm": "needs a SLURM cluster: test_slurm.py runs such sweeps on "
    "the tests' own one-node cluster",
    "tlab-train sweep=attention_kernels launcher=slurm": "needs a SLURM cluster and GPUs",
    "tlab-train sweep=lr_optuna experiment=mqar trainer=gpu": "needs GPUs and a PostgreSQL "
    "server (workers sharing a study: test_optuna_sweeps.py)",
    "optuna-dashboard": "a server that runs until stopped",
    "tlab-train model=gpt data=corpus 'data.sources=[hf:": "needs the Hugging Face hub (a saved "
    "data set's folder is a source that tests/data/test_corpus.py reads)",
    "tlab-eval ckpt_path=.../best.ckpt harness=field": "needs the Hugging Face hub for the "
    "tasks' data sets (the tests' own tasks run offline: the harness lines below)",
    "tlab-eval sweep_dir=": "a sweep of language models: tests/sweeps/test_sweep_harness.py "
    "scores one",
    "tlab-train trainer=ddp trainer.devices=8 trainer.num_nodes=4": "a SLURM job on GPUs: "
    "test_slurm.py runs its script on the tests' cluster, CPU tasks swapped in",
    "tlab-train size=340m": NO_GPU + ", and a corpus of billions of tokens",
    "tlab-train trainer=fsdp trainer.devices=8 size=340m": NO_GPU,
    "tlab-train trainer=fsdp_cpu": "2 processes for 30 s: tests/end_to_end/test_distributed.py "
    "trains with it against one process",
}

QUIET = ["trainer.enable_progress_bar=false", "logger=csv"]  # wandb: tested in test_train.py
TINY = ["debug=limit", *QUIET]  # 3 epochs of 3 training and 2 validation batches
# MQAR's, Zoology's and MAD's single runs: some 40 lines that differ in their kernel, its
# options and the task; one batch of each split (a third of the time of a TINY run)
ONE_BATCH = ["debug=fdr", *QUIET]
USER_GLOB = "attention=glob([distance,relu*])"  # the user's kernels, and relu beside relu2
SMALL_GPT = ["model.n_layer=1", "model.d_model=32", "model.n_head=2"]
LRA_SMALL = ["data.train_examples=64", "data.val_examples=16", "data.test_examples=16"]
# MQAR and MAD drawn small: Zoology's 100,000 examples or MAD's 12,800 are most of a tiny run
DRAWN_SMALL = ["data.train_examples=256", "data.val_examples=64"]
# extra overrides by the start of a command line (the first that matches)
BUDGET = [
    ("tlab-check", []),
    ("python -m transformers_lab.bench.kernels", ["--n", "128", "--repeats", "1", "--out", "b"]),
    (
        "python -m transformers_lab.bench.generation",
        ["--context", "32", "--new-tokens", "2", "--out", "b"],
    ),
    (
        "python -m transformers_lab.bench.long_context",
        ["--steps", "1", "--warmup", "0", "--overrides", "data.block_size=64", "--out", "b"],
    ),
    (
        "tlab-train -m experiment=mqar attention=relu2",  # docs/ablations.md's 36 jobs: 2
        [*TINY, "attention=relu2,softmax", "seed=0", "optimizer.lr=1e-3"],
    ),
    ("tlab-train ckpt_path=", [*TINY, "trainer.max_epochs=4"]),  # one epoch more than saved
    ("tlab-train experiment=baby_gpt trainer.max_tokens", [*QUIET, "trainer.max_tokens=15000"]),
    ("python -m transformers_lab.bench.fastmax_gpu --dry-run", []),  # the plan: no GPU needed
    ("python -m transformers_lab.bench.scale", ["--sizes", "340m", "--kernels", "softmax", "gla"]),
    ("python -m transformers_lab.bench.throughput", ["--steps", "12", "--repeats", "1"]),
    ("tlab-train debug=", QUIET),
    # every kernel of the package in one sweep (some 30 jobs); the same sweep with a
    # baseline, or with the user's config dir (its distance and relu2 found by a glob), on few
    (
        "tlab-train sweep=attention_kernels experiment=mqar 'summary.baseline",
        [*TINY, "hydra.sweeper.params.seed=0", "optimizer.lr=1e-3", "attention=softmax,dot"],
    ),
    (
        "tlab-train sweep=attention_kernels experiment=mqar hydra.searchpath=",
        [*TINY, "hydra.sweeper.params.seed=0", "optimizer.lr=1e-3", USER_GLOB],
    ),
    (
        "tlab-train sweep=attention_kernels",
        [*TINY, "hydra.sweeper.params.seed=0", "optimizer.lr=1e-3"],
    ),
    ("tlab-train sweep=lr_optuna", [*TINY, "hydra.sweeper.n_trials=2"]),
    (
        "tlab-train sweep=mad",
        [*TINY, "data=mad_in_context_recall,mad_compression", "optimizer.lr=1e-3", *DRAWN_SMALL],
    ),
    (
        "tlab-train sweep=zoology_mqar",
        [
            *TINY,
            "attention=softmax,linear",
            "model.d_model=32",
            "optimizer.lr=1e-2",
            "data.vocab_size=256",
            *DRAWN_SMALL,
        ],
    ),  # fmt: skip
    # Zoology's batch of 512 over a vocabulary of 8192: 2 s a step; a small batch runs the
    # same code (the commands set trainer.max_epochs=10: 30 steps)
    (
        "tlab-train sweep=length_generalisation data=needle_text",  # the other data: 1 job
        [*TINY, "extrapolation=softmax_rope", "optimizer.lr=1e-3"],
    ),
    (
        "tlab-train sweep=length_generalisation",  # 16 jobs: 2, at a tiny budget
        [*TINY, "extrapolation=softmax_rope,gla", "optimizer.lr=1e-3"],
    ),
    # the FAST paper's preset: 63 jobs a task, 2 here; LRA's tasks drawn small
    (
        "tlab-train sweep=fast_paper_",  # the paper's ViT and GPT tables: 108 and 198 jobs
        [*TINY, "attention=softmax,fastmax_p2", "optimizer.lr=1e-3", "seed=0"],
    ),
    (
        "tlab-train sweep=fast_paper launcher=joblib experiment=pixel_mnist",
        [*TINY, "attention=softmax,fastmax_p2", "optimizer.lr=1e-3", "seed=0"],
    ),
    (
        "tlab-train sweep=fast_paper",
        [*TINY, "attention=softmax,fastmax_p2", "optimizer.lr=1e-3", "seed=0", *LRA_SMALL],
    ),
    ("tlab-train experiment=lra_", [*TINY, *LRA_SMALL]),
    (
        "tlab-train -m launcher=joblib experiment=lra_pathfinder",  # fastmax's bound: 6 jobs, 1
        [*TINY, *LRA_SMALL, "optimizer.lr=1e-3", "seed=0"],
    ),
    ("tlab-train experiment=zoology_mqar", [*ONE_BATCH, "data.batch_size=16", *DRAWN_SMALL]),
    ("tlab-train -m experiment=zoology_mqar", [*TINY, "data.batch_size=16", *DRAWN_SMALL]),
    ("tlab-train experiment=mad", [*ONE_BATCH, *DRAWN_SMALL]),
    ("tlab-train experiment=mqar callbacks=", TINY),  # images every 2 epochs
    ("tlab-train experiment=mqar", ONE_BATCH),
    ("tlab-train model=gpt data=corpus", [*TINY, *SMALL_GPT, "data.block_size=32"]),
    ("tlab-prepare", []),
    ("tlab-train", TINY),
    ("tlab-sample", ["max_new_tokens=20"]),
    ("tlab-eval", []),
    ("tlab-export", []),
    ("tlab-translate", []),
    ("tlab-summarize", []),
]


def page_commands(page: Path) -> list[str]:
    """The command lines of a page's bash blocks, continuations joined, comments cut."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(re.sub(r"\s+", " ", line))
    return lines


def program_start(command: str) -> str:
    """The command without its leading ``VAR=value`` environment settings and ``srun``."""
    return re.sub(r"^(\w+=\S+ )*(srun )?", "", command)


def runnable(command: str) -> bool:
    return program_start(command).startswith(("tlab-", "python -m transformers_lab", "optuna-"))


def readme_block(first_line: str) -> str:
    """The code block of the README (or a docs/ page) that starts with ``first_line``."""
    for page in PAGES:
        for block in re.findall(r"```\w*\n(.*?)```", page.read_text(), re.S):
            if block.startswith(first_line + "\n"):
                return block
    raise AssertionError(f"no README or docs/ block starts with {first_line!r}")


def skip_reason(command: str) -> str | None:
    start = program_start(command)
    return next((why for s, why in SKIPPED.items() if start.startswith(s)), None)


def budget(command: str) -> list[str]:
    start = program_start(command)
    extra = next((extra for s, extra in BUDGET if start.startswith(s)), None)
    assert extra is not None, f"no BUDGET row for {command!r}: add one (or a SKIPPED reason)"
    return extra


ALL_LINES = {page.name: page_commands(page) for page in PAGES}
# each distinct line once: a command that two pages show runs once
COMMANDS = list(dict.fromkeys(c for lines in ALL_LINES.values() for c in lines if runnable(c)))


def test_the_readme_commands_are_found_and_the_skip_table_is_current():
    assert len(COMMANDS) >= 40 and sum("tlab-summarize" in c for c in COMMANDS) >= 3
    assert len(BENCH_LINES) > 1 and any("--config-dir" in c for c in BENCH_LINES)
    assert {"README.md", "kernels.md", "training.md", "sweeps.md", "ablations.md"} <= {
        name for name, lines in ALL_LINES.items() if any(runnable(c) for c in lines)
    }
    for start in SKIPPED:  # a skip reason for a line that is gone must go too
        assert any(program_start(c).startswith(start) for c in COMMANDS), start


def test_every_line_of_a_bash_block_is_run_or_a_make_target():
    """A line the test neither runs nor knows is a command no one checks: name it here."""
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    for name, lines in ALL_LINES.items():
        for line in lines:
            if runnable(line):
                continue
            assert line.startswith("make "), f"{name}: {line!r} is neither run nor a make target"
            assert line.split()[1] in targets, f"{name}: make {line.split()[1]} is no target"


def tlab(
    program: str,
    *args: str,
    cwd: Path,
    stdin: str | None = None,
    env_set: dict[str, str] | None = None,
) -> Done:
    """Run ``program`` (a script of this venv, or ``python -m``) with ``env_set`` on top, in
    a process of its own forked from one that has done the imports (``forked.py``)."""
    env = {**os.environ, "WANDB_MODE": "offline", "TLAB_ROOT": str(cwd), "PYTHONUNBUFFERED": "1"}
    paths = [(env_set or {}).pop("PYTHONPATH", ""), str(cwd), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)  # my_kernels, tests/user
    env.update(env_set or {})
    env.pop("WANDB_API_KEY", None)
    return server().run([program, *args], cwd=cwd, env=env, stdin=stdin or "", timeout=900)


@functools.cache
def server() -> Commands:
    """This test worker's command server, started at its first command."""
    commands = Commands(dict(os.environ))
    atexit.register(commands.close)
    return commands


def only_dir(folder: Path) -> Path:
    (found,) = [p for p in folder.iterdir() if p.is_dir()]
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """What the placeholders stand for: four trained runs and two sweeps."""
    if not DATA:
        pytest.skip("the README's data sets: set TLAB_DATA_DIR (../shared/data in CI)")
    root = tmp_path_factory.mktemp("readme")
    made: dict[str, Path] = {"root": root}
    for name, preset in (
        ("vit", []),
        ("gpt", ["experiment=baby_gpt"]),
        ("needles", ["experiment=needles", "eval_lengths=null"]),  # RoPE: any length
    ):
        proc = tlab("tlab-train", *preset, *TINY, f"hydra.run.dir=runs/{name}", cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[name] = root / "runs" / name
    proc = tlab(
        "tlab-train", "experiment=transformer_multi30k", *TINY, "task.bleu_batches=1",
        "hydra.run.dir=runs/transformer", cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    made["transformer"] = root / "runs" / "transformer"
    for name, kernels in (("sweep_a", "softmax,dot"), ("sweep_b", "fastmax_p1")):
        proc = tlab(
            "tlab-train", "-m", "experiment=mqar", f"attention={kernels}", *TINY,
            f"hydra.sweep.dir=sweeps/{name}", cwd=root,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[name] = root / "sweeps" / name
    (root / "sentences.txt").write_text("A dog runs.\nTwo men talk.\n")
    for path in ("my_kernels/distance.py", "my_conf/attention/distance.yaml"):  # the user's kernel
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(readme_block(f"# {path}"))
    (root / "my_kernels" / "__init__.py").write_text("")
    user = ROOT / "tests" / "user"  # relu2, the user kernel of docs/kernels.md and ablations.md
    (root / "my_conf" / "attention" / "relu2.yaml").write_text(
        (user / "my_conf" / "attention" / "relu2.yaml").read_text()
    )
    (root / "user_kernels").symlink_to(user / "user_kernels")
    (root / "tests").symlink_to(ROOT / "tests")  # PYTHONPATH=tests/user, as from a checkout
    made["prepared"] = write_corpus(root)
    return made


def write_corpus(root: Path) -> Path:
    """The user's corpus of docs/training.md: a folder of text files, a JSONL file and a
    Hugging Face tokenizer.json; prepared once as its tlab-prepare line does. Returns the
    prepared folder (its ``<key>``)."""
    from fake_data import write_hf_tokenizer

    words = ["the", "sea", "king", "rose", "night", "fair", "crown", "war", "love", "shore"]
    docs = [" ".join(words[(i * j) % 10] for j in range(120)) for i in range(400)]
    (root / "my_texts").mkdir()
    for i, doc in enumerate(docs):
        (root / "my_texts" / f"{i:03d}.txt").write_text(doc)
    (root / "corpus.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    write_hf_tokenizer(root / "tokenizer.json", docs)
    proc = tlab(
        "tlab-prepare", "data.sources=[corpus.jsonl]", "data.tokenizer=tokenizer.json",
        "data.prepared_dir=corpora", cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.split("prepared: ")[1].split()[0])


def fill_in(command: str, runs: dict[str, Path]) -> str:
    """The command with each placeholder replaced by a run made here."""
    program = command.split()[0]
    model = {"tlab-sample": "gpt", "tlab-translate": "transformer"}.get(program, "vit")
    if program == "tlab-export" or "harness" in command:  # a language model on text
        model = "gpt"
    if "eval_lengths=" in command:  # scored at other lengths: a GPT with RoPE, on passkeys
        model = "needles"
    ckpts = runs[model] / "checkpoints"
    for old, new in (
        ("logs/train/runs/<time>", runs["vit"]),
        ("logs/train/multiruns/<time>", runs["sweep_a"]),
        ("<sweep A>", runs["sweep_a"]),
        ("<sweep B>", runs["sweep_b"]),
        ("<run dir>", runs["vit"]),
        ("$PWD", runs["root"]),
        ("corpora/corpus-<key>", runs["prepared"]),
        (".../", f"{ckpts}/"),
        ("ckpt_path=... ", f"ckpt_path={ckpts}/last.ckpt "),
    ):
        command = command.replace(old, str(new))
    if command.endswith("ckpt_path=..."):
        command = command[: -len("...")] + f"{ckpts}/last.ckpt"
    assert "<" not in command and "..." not in command, f"a placeholder left in {command!r}"
    return command


KERNEL_BENCH = "python -m transformers_lab.bench.kernels"
# The kernel bench's lines differ in their kernels and lengths. Each variant is measured in
# a worker process of its own, some 5 s of imports each, so the first line measures and the
# bench's own parser checks the others: every flag, every variant's name resolved (the
# user's kernels of a config dir too; tests/attention/test_user_kernel_everywhere.py
# measures those by name, yaml and class).
BENCH_LINES = [c for c in COMMANDS if program_start(c).startswith(KERNEL_BENCH)]
# Joblib's workers each import torch afresh (some 10 s each on 2 cores): a sweep runs its
# jobs in its own process here (Hydra's basic launcher), its overrides as written;
# tests/sweeps/test_sweeps.py runs the joblib launcher itself.
IN_PROCESS = {"launcher=joblib"}


def run_as_written(command: str, runs: dict[str, Path]) -> None:
    if (why := skip_reason(command)) is not None:
        pytest.skip(why)
    words = [w for w in shlex.split(fill_in(command, runs)) if w not in IN_PROCESS]
    env_set = {}
    while re.fullmatch(r"\w+=\S+", words[0]):  # PYTHONPATH=tests/user tlab-train ...
        key, value = words.pop(0).split("=", 1)
        env_set[key] = value
    program, *args = words
    if command in BENCH_LINES[1:]:
        from transformers_lab.bench.kernels.cli import parse_args

        with contextlib.chdir(runs["root"]):  # its config dir, my_conf, is the user's
            parse_args([*args[2:], *budget(command)])  # a bad flag or variant exits with why
        return
    stdin = "A dog runs.\n" if program == "tlab-translate" and "text=" not in command else None
    proc = tlab(program, *args, *budget(command), cwd=runs["root"], stdin=stdin, env_set=env_set)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if program in ("tlab-sample", "tlab-translate"):
        assert proc.stdout.strip(), "no text came out"
    if "--curves" in args:
        assert (Path(args[0]) / "curves.png").is_file()


# The commands in two classes, every other one in each: the slow suite keeps a module's
# tests on one worker and a class's on one (make test-slow: --dist loadscope), so the two
# halves of this, its longest file, run on both workers, each building ``runs`` once.
HALVES = [
    [pytest.param(c, id=f"command{i}") for i, c in enumerate(COMMANDS) if i % 2 == half]
    for half in (0, 1)
]


@pytest.mark.slow
class TestEvenCommands:
    @pytest.mark.parametrize("command", HALVES[0])
    def test_a_readme_command_runs_as_written(self, command, runs):
        run_as_written(command, runs)


@pytest.mark.slow
class TestOddCommands:
    @pytest.mark.parametrize("command", HALVES[1])
    def test_a_readme_command_runs_as_written(self, command, runs):
        run_as_written(command, runs)
