# The whole set-up on a fresh machine: `make demo` runs the main job, `make test` the test suite.
# Re-running on a machine that already has .venv reinstalls nothing heavy: the install step
# runs again only when pyproject.toml changes (stamp file), and pip keeps an installed torch.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.memlayout-installed

.PHONY: demo test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[dev,runtimes,models]'
	touch $(STAMP)

# The planner on resnet18 at batch 2, 128x128 (smaller than the README's batch 8, 224x224
# benchmark so the demo stays short on two busy cores).
demo: $(STAMP)
	$(BIN)/memlayout optimize torchvision:resnet18 --batch 2 --image-size 128 --rounds 5

# Two pytest processes: the tests that build peer runtimes (OpenVINO, ONNX Runtime) in-process
# run apart from the rest. In one process, a later subprocess start segfaulted after them
# (Python's frame stack unmapped under it, in a session of several hundred tests).
# The suite runs on two pytest-xdist workers of one torch thread each: most of a test's time
# is single-threaded Python (tracing, export, Dynamo), so two workers finish it in about two
# thirds of one two-threaded process's time.
# mypy first (pyproject.toml says what it checks): code no test reaches, the CUDA paths among
# it, still has to name what exists.
# A third runs the tests marked `isa` again with ATen's kernels held to AVX2, so a machine with
# AVX-512 checks an AVX2-only CPU's path too; it collects only the files that use the marker
# (collecting the whole suite takes longer than these tests). Only where the CPU has AVX2: ATen
# takes the value unchecked, and AVX2 kernels on a CPU without it stop at an illegal instruction.
ISA_TESTS = grep -rl --include='test_*.py' 'mark\.isa' tests

test: $(STAMP)
	$(BIN)/python -m mypy src/memlayout
	$(BIN)/python -m pytest -q -n 2 -m "not runtimes"
	$(BIN)/python -m pytest -q -m runtimes tests
	if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then \
		ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest -q -m "isa and not runtimes" $$($(ISA_TESTS)); \
	else echo "no AVX2 on this CPU: the isa tests ran once, natively"; fi

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
