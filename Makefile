# The two commands of README: `make test` and `make run`. Everything else is a step of them.
BUILD_DIR := build
JOBS ?= $(shell nproc)
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: all deps configure build test test-cpp test-python python-deps run clean

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

run: build
	@./$(BUILD_DIR)/tools/xent-bench

clean:
	rm -rf build build-* build.configure.log python/xent/_C.so
