# The README's two commands: `make train` (install the runtime, prepare real data, train on
# CPU) and `make test` (add the test and docs extras, lint, run the test suite). Everything
# lives in .venv; `make docs` builds the documentation site (docs/, mkdocs.yml) and
# `make docs-serve` serves it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build that the reference machines carry on disk. GPU users: install your CUDA
# build of torch into $(VENV) first, or run `make setup TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
# The main job: a LoRA fine-tune of SmolLM2-135M on Shakespeare, then a sample from it.
# From scratch instead: make train RECIPE=recipes/gpt2_debug_shakespeare_cpu.yaml TOKENIZER=gpt2
RECIPE ?= recipes/smollm2_lora_shakespeare_cpu.yaml
TOKENIZER ?= smollm2-135m
PROMPT ?= ROMEO:
# Recipes log (and checkpoint) under runs/<recipe file name>.
CHECKPOINTS = runs/$(basename $(notdir $(RECIPE)))/checkpoints

.PHONY: setup setup-dev train test lint format docs docs-serve bench gpu-check interop-check clean

# `setup`: what plugintrain runs on (the runtime dependencies), all `make train` needs.
# `setup-dev`: adds the test and docs extras (transformers, peft, lm_eval, mkdocs, ...),
# which `make test`, `make lint` and `make docs` need.
setup: $(VENV)/.setup-done

$(VENV)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e .
	touch $@

setup-dev: $(VENV)/.setup-dev-done

# Debian's Chromium, which the MLflow UI screenshot test drives (tests/e2e/test_tracking_ui.py),
# is installed where apt-get runs as root; anywhere else that test skips, and nothing fails.
CHROMIUM_INSTALL := apt-get install -y --no-install-recommends chromium
$(VENV)/.setup-dev-done: $(VENV)/.setup-done
	$(BIN)/python -m pip install --quiet -e ".[test,docs]"
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		$(CHROMIUM_INSTALL) >/dev/null || { apt-get update -qq && $(CHROMIUM_INSTALL) >/dev/null; } || true; fi
	@[ -x /usr/bin/chromium ] || echo "No /usr/bin/chromium: the MLflow UI screenshot test will skip (install it: sudo $(CHROMIUM_INSTALL))"
	touch $@

train: setup
	$(BIN)/plugintrain prepare shakespeare --tokenizer $(TOKENIZER)
	$(BIN)/plugintrain fit --config $(RECIPE)
	$(BIN)/plugintrain generate --weights $(CHECKPOINTS) --prompt "$(PROMPT)" --max_new_tokens 60

lint: setup-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest-xdist workers, each test file on one (its module fixtures run once), the
# slowest files first (tests/conftest.py; xdist's own reordering off). Ranks and one-process
# commands are forked from a fork server, never from a worker, which has threads
# (tests/_processes.py). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The documentation site into site/, strictly: a broken link or anchor, a page missing from
# the navigation, a docstring naming nothing, a command the docs show that the command line
# refuses, or a figure without its command and date fails it. The CLI and API reference
# pages are generated from the parsers and docstrings at every build (docs/hooks/).
# `make test` builds it too (tests/e2e/test_docs_site.py, tests/unit/test_docs_commands.py).
DOCS_ENV := NO_MKDOCS_2_WARNING=1
docs: setup-dev
	$(BIN)/python docs/hooks/commands.py
	$(BIN)/python docs/hooks/figures.py
	$(DOCS_ENV) $(BIN)/mkdocs build --strict

# The site at http://127.0.0.1:8000, rebuilt when a page changes (DOCS_ADDR=0.0.0.0:8000
# to reach it from another machine).
DOCS_ADDR ?= 127.0.0.1:8000
docs-serve: setup-dev
	$(DOCS_ENV) $(BIN)/mkdocs serve --strict --dev-addr $(DOCS_ADDR)

format: setup-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The CPU benchmark matrix (about 12 minutes on two cores): JSON, Markdown and plots under
# runs/bench/. On a GPU machine: make bench MATRIX=benchmarks/gpu.yaml
MATRIX ?= benchmarks/cpu.yaml
bench: setup
	$(BIN)/plugintrain prepare shakespeare --tokenizer gpt2
	$(BIN)/plugintrain prepare shakespeare --tokenizer llama3
	$(BIN)/plugintrain bench --matrix $(MATRIX)

# One GPU, a few minutes: logits, reduced precisions and the one-process strategies on
# CUDA against the CPU, then GPT-2 124M and Llama 3.2 1B tokens/s, MFU and peak memory.
# One table, also as runs/gpu_check/gpu_check.json; without a GPU a dry run that says so.
# The same CUDA checks as tests: $(BIN)/pytest -m gpu
gpu-check: setup
	$(BIN)/python -m plugintrain.tools.gpu_check

# Every GGUF export checked with llama.cpp's own loader (interop/check.py): token ids,
# logits (f32 KV cache) and a greedy answer, f32/f16/bf16/q8_0. llama-cpp-python is built
# from source once (about 10-15 minutes on two cores) into a venv outside the repository.
# Not part of `make test`.
INTEROP_VENV ?= $(HOME)/.cache/plugintrain/interop/venv
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
interop-check: setup $(INTEROP_VENV)/.built
	$(BIN)/python interop/check.py --llama-python $(INTEROP_VENV)/bin/python

$(INTEROP_VENV)/.built:
	$(PYTHON) -m venv $(INTEROP_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(INTEROP_VENV)/bin/pip install --quiet numpy "$(LLAMA_CPP_PYTHON)"
	touch $@

clean:
	rm -rf $(VENV) runs build site *.egg-info .pytest_cache .ruff_cache
