# The two commands of README: `make test` and `make run`. Everything else is a step of them.
BUILD_DIR := build
JOBS ?= $(shell nproc)
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: all deps configure build test test-cpp run clean

all: build

deps:
	@bash scripts/deps.sh

configure: deps
	@cmake --preset default -Wno-dev >$(BUILD_DIR).configure.log 2>&1 || (cat $(BUILD_DIR).configure.log; exit 1)

build: configure
	@cmake --build --preset default -j $(JOBS)

test-cpp: build
	@ctest --preset default -j $(JOBS)

test: test-cpp

run: build
	@./$(BUILD_DIR)/tools/xent-bench

clean:
	rm -rf build build-* build.configure.log
