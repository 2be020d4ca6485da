# musique_rl: `make` lists the targets. Every target that needs the environment builds it first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
GPU_STAMP := $(VENV)/.installed-gpu
# A .venv made by `make setup-gpu` stays a GPU one: every target's set-up step then keeps the gpu
# extra (vLLM's CUDA torch), never the CPU torch of `make setup`.
STAMP := $(if $(wildcard $(GPU_STAMP)),$(GPU_STAMP),$(VENV)/.installed)
SWEEP ?= h02
SWEEP_DIR ?=
HYP ?= h01
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup setup-gpu check-gpu-pins fetch-musique train test test-slow warm-start sweep publish check-status \
	case-study slurm-up slurm-down ui ui-check cfg lint bench clean

help: ## Show this menu
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first from its pin, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q -c constraints-cpu.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[dev,lucene,semantic]'
	touch $@

$(GPU_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# vLLM 0.30.0 brings its CUDA build of torch 2.13.0 (the gpu extra; pins checked by make check-gpu-pins)
	$(BIN)/pip install -q -e '.[gpu,dev]'
	touch $@

setup: $(STAMP) ## Create .venv and install the package (dev, lucene, semantic extras; CPU torch)

setup-gpu: $(GPU_STAMP) ## A GPU node with its own CUDA driver: .venv with the gpu extra (vLLM, CUDA torch, DeepSpeed)

check-gpu-pins: ## Do the gpu extra's pins resolve with the project's on Python 3.11 and 3.12 (PyPI, ~2 min, nothing installed)?
	$(PY) .ci/gpu_pins.py

MUSIQUE_DIR ?= $(or $(MUSIQUE_RL_DATA),data/musique)
fetch-musique: $(STAMP) ## MuSiQue-Ans (train, validation) from the Hugging Face Hub into MUSIQUE_DIR (default $MUSIQUE_RL_DATA, else data/musique)
	$(BIN)/python -m musique_rl.data fetch --out $(MUSIQUE_DIR)

train: $(STAMP) ## Run the main job: tiny model, embedded data, GRPO (ARGS="key=value ..." to override)
	$(BIN)/python -m musique_rl $(ARGS)

test: $(STAMP) ## Fast test suite: 19 min 21 s on the 2-core AMD EPYC beside two mutation jobs (2026-11-28, CI of 45108b8 on a clean clone, no ../shared: 928 passed + 34 skipped; 18 min 17 s at 047a5e0 with the data: 954 passed + 5 skipped)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP) ## Slow end-to-end suite (learning runs, faults, SLURM)
	$(BIN)/python -m pytest -q -m slow

warm-start: $(STAMP) ## Build the shipped tiny warm starts that are missing (default, arith; SFT until the gate holds); commit musique_rl/warm_starts/
	$(BIN)/python -m musique_rl.warm_start --ship $(ARGS)

sweep: $(STAMP) ## Run a named hypothesis sweep and its verdict (sweep dir + MLflow): make sweep SWEEP=h02
	$(BIN)/python -m musique_rl -m +sweep=$(SWEEP) $(ARGS)

publish: $(if $(SWEEP_DIR),$(STAMP)) ## Publish a sweep's verdict in docs/STATUS.md: make publish SWEEP_DIR=multirun/h02/<date> (refuses short, dirty, mixed, failed)
	@test -n "$(SWEEP_DIR)" || { echo "make publish: name the sweep: make publish SWEEP_DIR=multirun/h02/<date>_<time>" >&2; exit 2; }
	$(BIN)/python -m musique_rl.verdict publish --sweep $(SWEEP_DIR) $(ARGS)

check-status: $(STAMP) ## Every published row of docs/STATUS.md is from one clean commit, one machine type, no failed job
	$(BIN)/python -m musique_rl.verdict check

SEEDS ?= 1,2,3
case-study: $(STAMP) ## The original researcher's flat reward replayed and fixed (30 min on 2 cores, seeds 1-3): docs/case_study/case_study.md
	$(BIN)/python -m musique_rl.case_study --run --publish --seeds $(SEEDS) $(ARGS)

slurm-up: ## Start a single-node SLURM cluster on localhost (installs slurm-wlm, munge, MariaDB; root)
	bash launchers/slurm_local.sh up

slurm-down: ## Stop the local SLURM cluster
	bash launchers/slurm_local.sh down

ui: $(STAMP) ## MLflow UI on http://127.0.0.1:5000 over the local store
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db}

ui-check: $(STAMP) ## Headless-browser check of the compare view (installs chromium if missing): compare.png
	bash launchers/install_browser.sh
	$(BIN)/python launchers/mlflow_compare_screenshot.py --out compare.png $(ARGS)

cfg: $(STAMP) ## Print the composed, resolved config of a hypothesis: make cfg HYP=h01
	$(BIN)/python -m musique_rl --cfg job --resolve +hypothesis=$(HYP) $(ARGS)

# The smoke runs on the interpreter whose torch sees the GPU: the .venv's where there is one (`make
# setup` installs a CPU torch), else $(PY), a CUDA image's own python.
SMOKE_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
.PHONY: gpu-smoke
gpu-smoke: ## Every fault, hypothesis arm and a 7B-shaped model on this machine's GPU; a table (CPU: small shapes)
	$(SMOKE_PY) -m musique_rl.smoke $(ARGS)

# gpu-bundle on a CPU machine with pip and the .venv; gpu-check on the GPU machine (its own python3
# with the bundle's wheels: bash .gpu_bundle/run.sh does both steps there), docs/howto/gpu.md.
GPU_BUNDLE ?= .gpu_bundle
.PHONY: gpu-bundle gpu-check gpu-plan
gpu-bundle: $(STAMP) ## Build .gpu_bundle/ (GPU_BUNDLE=dir) for a lent GPU machine: Python 3.12 wheels, Qwen2.5 stand-in tokenizer, run.sh (< 64 MB)
	$(BIN)/python -m musique_rl.gpu_check --prepare $(GPU_BUNDLE) $(ARGS)

gpu-check: ## Everything a GPU can check here, time-boxed, one table in docs/records/gpu_check_<gpu>.md (prints its plan first; CPU: small shapes)
	$(SMOKE_PY) -m musique_rl.gpu_check $(if $(wildcard $(GPU_BUNDLE)/PROVENANCE.json),--bundle $(GPU_BUNDLE)) $(ARGS)

gpu-plan: ## The lease's schedule with the H200 step times (no GPU, no run): bench and 7B steps within the budget
	$(SMOKE_PY) -m musique_rl.gpu_check --plan $(ARGS)

lint: $(STAMP) ## ruff over the package, tests and benchmarks
	$(BIN)/ruff check musique_rl tests benchmarks

clean: ## Remove outputs/ and multirun/ job directories (keeps mlflow.db)
	rm -rf outputs && find multirun -mindepth 1 ! -name README.md -exec rm -rf {} +
