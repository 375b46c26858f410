# transformers_lab: common tasks. `make help` lists them.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH_ARGS ?=
PYTEST_ARGS ?=
ARGS ?=

.PHONY: help install slurm train ablate zoology mad test test-slow test-gpu bench-gpu gpu-window lint format docs bench bench-long bench-training bench-corpus bench-study notebooks clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

install: $(VENV)/.installed  ## create .venv and install the package with its dev tools (idempotent)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# the SLURM tests' one-node cluster (tests/slurm.py) needs Debian's slurm-wlm and munge;
# root installs them from the package registry, as CI does; without them those tests skip
SLURM_PACKAGES = slurm-wlm munge
slurm:  ## install SLURM and munge from Debian's packages (root; CI runs it) for the SLURM tests
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null; then \
		echo "SLURM and munge are installed"; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "SLURM is not installed and this needs root and apt-get: the SLURM tests will skip"; \
	else \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get install -y -q $(SLURM_PACKAGES) >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q $(SLURM_PACKAGES) >/dev/null; }; } \
		&& echo "installed $(SLURM_PACKAGES)"; \
	fi

train: install  ## the default experiment (ViT on digits, offline, ~1 min); ARGS="experiment=baby_gpt ..."
	$(VENV)/bin/tlab-train $(ARGS)

ABLATE_BUDGET ?= trainer.max_steps=2200
# softmax, fastmax of order 1 and 2 (the FAST paper) and GLA (the gated family), the slowest
# first. Each starts at 2 rates (3e-4, 1e-3) and the grid grows past its edge (ABLATE_GROW
# rounds at most) until each kernel's best rate lies inside it: 26 jobs, 18 min 53 s on a
# slow day's 2 cores (docs/ablations.md, section 5). Gated DeltaNet and Based are left out
# for time (their 12 jobs would add about 12 min): ABLATE_KERNELS=gated_deltanet,gla,... adds
# them back; every kernel: ABLATE_KERNELS='glob(*,exclude=[fastmax,sliding_window])'
ABLATE_KERNELS ?= gla,fastmax_p2,fastmax_p1,softmax
ABLATE_GROW ?= hydra.sweeper.grow=3

ablate: install  ## the kernel ablation on MQAR: 4 of the field's kernels (ABLATE_KERNELS) x 2 seeds, each at its best rate, the rate grid grown until that lies inside it (ABLATE_GROW), 2200 steps a job (ABLATE_BUDGET), offline, 2 jobs at a time; prints the table, saves summary.png
	WANDB_MODE=$(or $(WANDB_MODE),offline) $(VENV)/bin/tlab-train sweep=attention_kernels experiment=mqar launcher=joblib trainer.enable_progress_bar=false "hydra.sweeper.params.attention='$(ABLATE_KERNELS)'" $(ABLATE_BUDGET) $(ABLATE_GROW) $(ARGS)

zoology: install  ## Zoology's MQAR figure at CPU scale (sweep=zoology_mqar): grid.png, state.png, summary.md; see docs/ablations.md for its time
	WANDB_MODE=$(or $(WANDB_MODE),offline) $(VENV)/bin/tlab-train sweep=zoology_mqar trainer.enable_progress_bar=false $(ARGS)

mad: install  ## MAD's six tasks at CPU scale for softmax (sweep=mad; ARGS="attention=softmax,fastmax_p2" for more kernels)
	WANDB_MODE=$(or $(WANDB_MODE),offline) $(VENV)/bin/tlab-train sweep=mad trainer.enable_progress_bar=false $(ARGS)

# The default suite in two worker processes of one thread each (a test file stays on one
# worker, so its module fixtures are built once; a test class too: the README's commands
# are two classes, one a worker); the slow suite likewise.
TEST_RUN = WANDB_MODE=offline OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadscope

test: install  ## the default suite, every test not marked slow (under 8 min on 2 cores)
	$(TEST_RUN) -m "not slow" $(PYTEST_ARGS)

test-slow: install  ## the tests marked slow: end-to-end trainings, notebooks, every documented command (CI runs both)
	$(TEST_RUN) -m slow $(PYTEST_ARGS)

test-gpu: install  ## the tests marked gpu, on a machine with a CUDA GPU (elsewhere they skip): every kernel's contract, bf16 autocast, GPT steps eager and compiled, fla's kernels where installed
	WANDB_MODE=offline $(PY) -m pytest -m gpu -n $(or $(GPU_WORKERS),8) tests/gpu $(PYTEST_ARGS)

# the GPU bench: softmax through SDPA's flash backend (bf16), every kernel a fused kernel covers
# on our loop (_loop), on its backends (_fla, _flex: attention.backend) and fla's op alone
# (_fla_op), each warmed up at the timed N (fla autotunes at each new shape).
# fastmax_p2_compiled took over 150 s to compile at head_dim 64 on an H200: name it to try.
GPU_KERNELS ?= softmax linear_loop linear_fla linear_fla_op linear_compiled based_loop based_fla \
	based_flex based_fla_op fastmax_p1_loop fastmax_p1_fla fastmax_p1_flex fastmax_p1_fla_op \
	fastmax_p2_loop fastmax_p2_fla fastmax_p2_flex fastmax_p2_fla_op performer_loop performer_fla \
	cosformer_loop cosformer_fla retnet_loop retnet_fla gla_loop gla_fla simple_gla_loop \
	simple_gla_fla deltanet_loop deltanet_fla gated_deltanet_loop gated_deltanet_fla \
	sliding_window_loop sliding_window_flex
GPU_BENCH_ARGS ?= --n 4096 16384 65536 --batch 2 --heads 8 --head-dim 64 --repeats 10

bench-gpu: install  ## the kernel bench on a CUDA GPU, in bf16, beside SDPA's flash attention and fla's kernels: bench_out/gpu/
	$(PY) -m transformers_lab.bench.kernels --device cuda --in-process --causal causal --dtype bfloat16 --kernels $(GPU_KERNELS) $(GPU_BENCH_ARGS) --out bench_out/gpu $(BENCH_ARGS)

gpu-window: install  ## one prepared GPU run, under 10 min: env, the bench at N=4096/16384/65536, the gpu tests, every backend in bf16; a result after each step in bench_out/gpu_window (ARGS="--dry-run" walks it anywhere)
	$(PY) -m transformers_lab.bench.gpu_window --out bench_out/gpu_window $(ARGS)

docs: install  ## rewrite the README's kernel table from the registered kernels (ARGS="--config-dir my_conf": yours too)
	$(PY) -m transformers_lab.attention --readme README.md $(ARGS)

lint: install  ## ruff lint and format check
	$(VENV)/bin/ruff check transformers_lab tests
	$(VENV)/bin/ruff format --check transformers_lab tests

format: install  ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix transformers_lab tests
	$(VENV)/bin/ruff format transformers_lab tests

bench: install  ## benchmark the attention kernels (BENCH_ARGS="--n 1024 2048 ...")
	$(PY) -m transformers_lab.bench.kernels $(BENCH_ARGS)

bench-long: install  ## long-context training: tokens/s and peak memory of experiment=gpt_long_context per kernel (BENCH_ARGS=...)
	$(PY) -m transformers_lab.bench.long_context $(BENCH_ARGS)

bench-training: install  ## framework overhead: tlab-train against a bare PyTorch loop (BENCH_ARGS=...)
	$(PY) -m transformers_lab.bench.training $(BENCH_ARGS)

bench-corpus: install  ## data=corpus: preparing 1 GB of text against tiktoken's batch encode, and a baby GPT step on shards against one in memory (BENCH_ARGS=...)
	$(PY) -m transformers_lab.bench.corpus $(BENCH_ARGS)

notebooks: install  ## run every notebook top to bottom (what the tests do); outputs are not saved
	WANDB_MODE=offline $(PY) -m pytest tests/end_to_end/test_notebooks.py $(PYTEST_ARGS)

bench-study: install  ## pruning's saving: sweep=lr_optuna on MQAR with pruner=none and median (BENCH_ARGS=...)
	WANDB_MODE=$(or $(WANDB_MODE),offline) $(PY) -m transformers_lab.bench.study $(BENCH_ARGS)

clean:  ## remove caches and benchmark outputs (keeps .venv)
	rm -rf .pytest_cache .ruff_cache bench_out build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
