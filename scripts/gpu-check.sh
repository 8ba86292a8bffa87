#!/usr/bin/env bash
# The whole check on a machine with a GPU, from a fresh checkout (googletest sources in
# third_party/googletest when the system has none):
#   configure for the GPU (Hopper: sm_90a), build, ctest (labels cpu and gpu), compute-sanitizer
#   memcheck and racecheck on a subset of the GPU tests and racecheck on the fused products'
#   hand-overs, the kernels' bandwidth probe, xent-bench's
#   docs/performance.md suite and the PyTorch comparison when they are there.
# Usage: scripts/gpu-check.sh OUTDIR      (logs and JSON land in OUTDIR; a summary prints last)
# Records name the commit from XENT_COMMIT when set, else from git. Set it whenever the tree was
# copied: a copy's git metadata can be older than its files (records once named a stale commit).
# Environment: GPU_CHECK_SKIP="cpu,racecheck,..." skips steps by name; GPU_CHECK_DEADLINE=SECONDS
# caps the whole run (steps are cut to fit); JOBS sets build parallelism; GPU_CHECK_GTEST_FILTER
# runs the GPU test binary with that gtest filter instead of every ctest "gpu" case, in
# GPU_CHECK_SHARDS (default 8) shards side by side;
# GPU_CHECK_BENCH_SUITES="perf-ce perf-distill" runs those xent-bench suites (default: perf), one
# JSON each (bench-SUITE.json); GPU_CHECK_TORCH_ARGS="--suite perf-ce" sets compare_torch.py's
# arguments (default: its docs/performance.md run); GPU_CHECK_PYTEST_FILTER="-k fused" narrows the Python GPU
# tests, run in GPU_CHECK_PYTEST_PARTS (default 4) parts side by side. Anchor libraries (Liger, Cut Cross-Entropy, QuACK) are installed from wheels in .whl/
# when that folder is there (bench/README.md says how they are fetched).
# GPU_CHECK_SEED_SWEEP=N sweeps the CPU suite under N seeds (from GPU_CHECK_SEED_FIRST, default 1)
# on all cores but two, beside the GPU steps, for at most GPU_CHECK_SEED_SECONDS (default 400):
# the GPU tests leave the cores idle. Timings taken while it runs share the CPU: skip them.
# GPU_CHECK_ARCH=80 builds for that architecture alone (in build-gpu-sm80): an sm_80 build runs on
# Hopper through the driver's JIT and reaches only the portable paths. GPU_CHECK_PORTABLE=1 forces
# the portable paths in every GPU step (XENT_TEST_PORTABLE_PATHS=1, compare_torch.py
# --portable-paths) on whatever build.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu-check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUILD=build-gpu${GPU_CHECK_ARCH:+-sm$GPU_CHECK_ARCH}
if [[ "${GPU_CHECK_PORTABLE:-}" == 1 ]]; then
  export XENT_TEST_PORTABLE_PATHS=1
  GPU_CHECK_TORCH_ARGS="${GPU_CHECK_TORCH_ARGS:-} --portable-paths"
fi
# The driver compiles PTX of an older architecture once per kernel and caches it: room for all.
[[ -n "${GPU_CHECK_ARCH:-}" ]] && export CUDA_CACHE_MAXSIZE=4294967296
JOBS="${JOBS:-$(nproc)}"
export PATH="$PATH:/usr/local/cuda/bin"
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
STEP_SKIP="${GPU_CHECK_SKIP:-}"
STEP_DEADLINE="${GPU_CHECK_DEADLINE:-}"
STEP_SKIP_NAME=GPU_CHECK_SKIP STEP_DEADLINE_NAME=GPU_CHECK_DEADLINE

nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
cmake --version | head -n 1 >"$OUT/tools.log"
nvcc --version | tail -n 2 >>"$OUT/tools.log"

# Hopper wants sm_90a (wgmma, setmaxnreg); CMake spells it "90a" in CMAKE_CUDA_ARCHITECTURES from
# 3.24 on (the gpu preset). If this CMake refuses it, pass the -gencode form by hand instead.
configure() {
  local cc
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d .)"
  local arch="${cc:-90}"
  [[ "$arch" == 90 ]] && arch=90a
  [[ -n "${GPU_CHECK_ARCH:-}" ]] && arch="$GPU_CHECK_ARCH"
  echo "GPU compute capability: ${cc:-unknown}; CUDA architecture: $arch"
  if cmake -S . -B "$BUILD" -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=Release -DXENT_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES="$arch" -DXENT_PYTHON=ON \
      -DPython3_EXECUTABLE="$(command -v python3)"; then
    return 0
  fi
  echo "CMAKE_CUDA_ARCHITECTURES=$arch refused; retrying with explicit -gencode flags"
  rm -rf "$BUILD"
  cmake -S . -B "$BUILD" -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=Release -DXENT_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=OFF \
    -DCMAKE_CUDA_FLAGS="-gencode=arch=compute_${arch},code=sm_${arch}"
}

export BUILD
step configure 300 bash -c "$(declare -f configure); configure" || { print_summary; exit 1; }
# The library and test binaries first: a tool that does not build must not stop the tests.
step build 900 cmake --build "$BUILD" -j "$JOBS" --target xent_tests xent_gpu_tests xent_torch \
  || { print_summary; exit 1; }
step build-bench 900 cmake --build "$BUILD" -j "$JOBS" --target xent-bench
step build-all 900 cmake --build "$BUILD" -j "$JOBS"
cuobjdump --list-elf "$BUILD/libxent.a" 2>/dev/null | sed 's/.*\.\(sm_[0-9a-z]*\)\..*/\1/' \
  | sort | uniq -c >>"$OUT/tools.log" || true

SWEEP_PID=""
if [[ -n "${GPU_CHECK_SEED_SWEEP:-}" ]]; then
  cores=$(nproc)
  sweep_start=$SECONDS
  taskset -c "2-$((cores - 1))" scripts/seed-sweep.sh -n "$GPU_CHECK_SEED_SWEEP" \
    -s "${GPU_CHECK_SEED_FIRST:-1}" -j "$((cores - 2))" -c 2 -d "${GPU_CHECK_SEED_SECONDS:-400}" \
    -b "$BUILD/tests/cpp/xent_tests" -l "$OUT/sweep.log" >"$OUT/sweep.out" 2>&1 &
  SWEEP_PID=$!
fi
step cpu 900 ctest --test-dir "$BUILD" -L cpu -j "$JOBS" --timeout 600 --output-on-failure
# GPU test processes share the one GPU; a few at a time keeps memory and contexts in bounds.
GPU_TESTS="$BUILD/tests/cpp/xent_gpu_tests"
if [[ -n "${GPU_CHECK_GTEST_FILTER:-}" ]]; then
  # In shards side by side (GPU_CHECK_SHARDS, default 8): the suites' float64 references are
  # CPU-bound, so one process leaves the GPU and the other cores waiting.
  step gpu 900 scripts/gtest-shards.sh "$GPU_TESTS" "$GPU_CHECK_GTEST_FILTER" \
    "${GPU_CHECK_SHARDS:-8}" "$OUT/gpu-shards"
else
  step gpu 900 ctest --test-dir "$BUILD" -L gpu -j 4 --timeout 600 --output-on-failure
fi

# The Python package on the GPU: autograd, torch.compile, CUDA graphs, CUDA-vs-CPU; in parts side
# by side (GPU_CHECK_PYTEST_PARTS, default 4), as the C++ shards.
# shellcheck disable=SC2086
step pytest 900 scripts/pytest-shards.sh "${GPU_CHECK_PYTEST_PARTS:-4}" "$OUT/pytest-parts" \
  ${GPU_CHECK_PYTEST_FILTER:-}

# The probe before the sanitizers: its numbers matter most when GPU_CHECK_DEADLINE cuts the run.
step probe 600 "$GPU_TESTS" --gtest_also_run_disabled_tests --gtest_filter='*BandwidthProbe*'

# Sanitizers run a subset: every kernel path of the row kernels (cluster splits, streaming,
# unaligned, errors) plus a slice of the shared grids; the full grids under memcheck take hours.
SANITIZER_FILTER="${SANITIZER_FILTER:-Paths/CudaCeRowKernel.*:Paths/CudaDistillRowKernel.*:CudaCeErrors.*:*CeGrid*bf16*:*DistillGrid*bf16*}"
if command -v compute-sanitizer >/dev/null; then
  step memcheck 900 compute-sanitizer --tool memcheck --error-exitcode 1 "$GPU_TESTS" \
    --gtest_filter="$SANITIZER_FILTER" --gtest_brief=1
  step racecheck 900 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \
    "$GPU_TESTS" --gtest_filter="$SANITIZER_FILTER" --gtest_brief=1
  # The fused Hopper products' shared-memory hand-overs (mbarriers), on cases small enough for
  # racecheck to finish: one block, a block of several tiles, fp32 ∂W, ≈ 5 tiles per CTA, and the
  # reference form of the gradient product (with and without its fallback kernels). The
  # grid's larger cases take minutes each under racecheck, and some run a cuBLASLt kernel for
  # which racecheck reports same-value byte writes (docs/archive/perf-notes.md, decision 60).
  FUSED_RACECHECK_FILTER="${FUSED_RACECHECK_FILTER:-$(printf 'Grid/CudaStatisticsBlocks.MatchesReference/%s:' \
    d_fused_bf16_N300_H72_V4099_plain_mean_dW_one chunks_fused_bf16_N300_H72_V4099_plain_mean_dW_one \
    d_fused_f16_N1000_H136_V4099_smoothing_zloss_softcap_scale_rowweight_sum_dWfp32_row_tiles \
    chunks_fused_f16_N300_H72_V4099_smoothing_zloss_softcap_scale_rowweight_mean_dWfp32_several)CudaFusedGradientShare.*:Options/CudaReferenceOptions.MatchesReference/plain_mean:Cases/CudaReferenceSpecial.MatchesReference/huge_losses}"
  step racecheck-fused 900 compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 1 \
    "$GPU_TESTS" --gtest_filter="$FUSED_RACECHECK_FILTER" --gtest_brief=1
else
  note_skip memcheck "compute-sanitizer not found"
  note_skip racecheck "compute-sanitizer not found"
  note_skip racecheck-fused "compute-sanitizer not found"
fi

if [[ -x "$BUILD/tools/xent-bench" ]]; then
  for suite in ${GPU_CHECK_BENCH_SUITES:-perf}; do
    step "bench-$suite" 900 "$BUILD/tools/xent-bench" --suite "$suite" --device cuda \
      --json "$OUT/bench-$suite.json"
  done
else
  note_skip bench "$BUILD/tools/xent-bench not built yet"
fi
if [[ -d .whl ]] && ! step_skipped torch; then
  # Anchors travel as wheels (no network on a GPU machine); QuACK's large DSL library as an
  # archive, .whl/cutlass-dsl-libs.tar.xz (its libs-core and libs-cu13 wheels unpacked and
  # re-compressed to about half the size), unpacked into the same folder. The folder is named
  # site-packages on purpose: QuACK fingerprints every function its epilogues reach unless the
  # function's file lies under a site-packages (or dist-packages) folder, and the DSL's own
  # functions then fail it ("epilogue fn depends on <Logger CUTE_DSL> ... no fail-closed
  # semantic key"; the failure once seen with DSL 4.8.1, on a ContextVar, is the same message).
  ANCHORS=/tmp/anchors/site-packages
  mkdir -p "$ANCHORS"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$ANCHORS" .whl/*.whl \
    >"$OUT/anchors.log" 2>&1 || echo "anchor wheels: install failed (see anchors.log)"
  [[ -f .whl/cutlass-dsl-libs.tar.xz ]] && tar xJf .whl/cutlass-dsl-libs.tar.xz -C "$ANCHORS"
  export PYTHONPATH="$ANCHORS:$ANCHORS/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}"
fi
if [[ -f tools/compare_torch.py ]]; then
  # shellcheck disable=SC2086
  step torch 900 env PYTHONPATH="$PWD/python:${PYTHONPATH:-}" python3 tools/compare_torch.py \
    ${GPU_CHECK_TORCH_ARGS:-} --json "$OUT/torch.json"
else
  note_skip torch "tools/compare_torch.py not present yet"
fi

if [[ -n "$SWEEP_PID" ]]; then
  sweep_status=0
  wait "$SWEEP_PID" || sweep_status=$?
  line="$(tail -n 1 "$OUT/sweep.out" | cut -c1-90)"
  summary_line seed-sweep "$([[ $sweep_status -eq 0 ]] && echo PASS || echo FAIL)" \
    "$((SECONDS - sweep_start))s" "$line"
fi

echo
echo "== bandwidth probe (fraction of copy bandwidth) =="
grep -E '^(copy|case|ce |distill )' "$OUT/probe.log" 2>/dev/null || echo "(no probe output)"
echo
echo "== gpu-check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)) =="
print_summary
