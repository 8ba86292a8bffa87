# The two commands of README: `make test` and `make run`. Everything else is a step of them.
BUILD_DIR := build
JOBS ?= $(shell nproc)
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: all deps configure build test test-cpp test-python test-wheel python-deps run lint format lint-deps clean

# One seed for every test of a run (C++ and Python), printed first by each, so a failure in a log
# replays with `make test XENT_TEST_SEED=N`; random unless given.
ifeq ($(origin XENT_TEST_SEED),undefined)
XENT_TEST_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
export XENT_TEST_SEED

all: build

deps:
	@bash scripts/deps.sh

configure: deps
	@cmake --preset default -Wno-dev >$(BUILD_DIR).configure.log 2>&1 || (cat $(BUILD_DIR).configure.log; exit 1)

build: configure
	@cmake --build --preset default -j $(JOBS)

test-cpp: build
	@echo "C++ tests: XENT_TEST_SEED=$(XENT_TEST_SEED)"
	@ctest --preset default -j $(JOBS)

# The PyTorch package: install torch & co. (scripts/deps-python.sh), configure again so CMake
# finds torch, build the binding into python/xent, run the Python tests (the GPU ones skip
# themselves without a CUDA device).
PYTHON ?= python3
python-deps:
	@bash scripts/deps-python.sh

test-python: build python-deps
	@cmake --preset default -Wno-dev -DPython3_EXECUTABLE="$$(command -v $(PYTHON))" \
		>$(BUILD_DIR).configure.log 2>&1 || (cat $(BUILD_DIR).configure.log; exit 1)
	@cmake --build --preset default --target xent_torch -j $(JOBS)
	@echo "Python tests: XENT_TEST_SEED=$(XENT_TEST_SEED)"
	@PYTHONPATH=$(CURDIR)/python $(PYTHON) -m pytest -q -p no:cacheprovider tests/python

test: test-cpp test-python

# The installable package: a CPU-only wheel built against the installed torch, repaired to a
# manylinux tag with its system libraries vendored, installed into a fresh venv and checked there.
test-wheel: deps python-deps
	@bash scripts/wheel.sh
	@bash scripts/wheel-smoke.sh

# `make run` builds only the benchmark it runs: the CPU backend alone when this machine has no
# NVIDIA GPU (no CUDA compile, no tests), the CUDA backend when it has one.
HAVE_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
RUN_PRESET := $(if $(HAVE_GPU),default,cpu)
RUN_BUILD_DIR := $(if $(HAVE_GPU),$(BUILD_DIR),$(BUILD_DIR)-cpu)

run:
	@bash scripts/deps.sh $(if $(HAVE_GPU),,--cpu)
	@echo "make run: configuring ($(if $(HAVE_GPU),CUDA: a GPU is present,CPU only: no GPU found)), preset $(RUN_PRESET)"
	@cmake --preset $(RUN_PRESET) -Wno-dev -DXENT_BUILD_TESTS=OFF -DXENT_PYTHON=OFF \
		>$(RUN_BUILD_DIR).configure.log 2>&1 || (cat $(RUN_BUILD_DIR).configure.log; exit 1)
	@echo "make run: building xent-bench"
	@cmake --build --preset $(RUN_PRESET) --target xent-bench -j $(JOBS)
	@echo "make run: running $(RUN_BUILD_DIR)/tools/xent-bench"
	@./$(RUN_BUILD_DIR)/tools/xent-bench

# Format checks (CI runs them): clang-format for C++/CUDA, ruff for Python. `make format` applies
# both. Versions are pinned (scripts/deps.sh, LINT_DEPS) so every machine formats alike.
CLANG_FORMAT ?= $(shell command -v clang-format-14 || command -v clang-format)
CXX_SOURCES = $(shell git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')
lint-deps: deps
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet \
		--disable-pip-version-check --root-user-action=ignore "ruff==0.17.6"

lint: lint-deps
	@$(CLANG_FORMAT) --dry-run -Werror --style=file $(CXX_SOURCES)
	@$(PYTHON) -m ruff check --quiet .
	@$(PYTHON) -m ruff format --check --quiet .
	@echo "lint: clang-format and ruff clean ($(words $(CXX_SOURCES)) C++/CUDA files)"

format: lint-deps
	@$(CLANG_FORMAT) -i --style=file $(CXX_SOURCES)
	@$(PYTHON) -m ruff check --fix --quiet .
	@$(PYTHON) -m ruff format --quiet .

clean:
	rm -rf build build-* build.configure.log python/xent/_C.so
