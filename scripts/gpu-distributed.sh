#!/usr/bin/env bash
# The vocabulary-parallel check on a machine with 2 or more GPUs (docs/semantics.md §5, docs/performance.md row
# "vocab-parallel"): builds the PyTorch package for the GPU, runs tests/python/dist_check.py under
# torchrun over NCCL (correctness on CUDA of ce, linear_ce, distill of every kind and top-k distill, then the
# timings as JSON: ce, linear_ce, distill at 4096 x 131072), then, if time is left, the sharded
# gtests of the GPU test binary. Run it after scripts/gpu-check.sh: the build in build-gpu is
# then incremental. Under 6 minutes on 2 x H200.
# Usage: scripts/gpu-distributed.sh OUTDIR     (logs and dist.json land in OUTDIR; summary last)
# Environment: NPROC (GPUs, default 2), JOBS (build parallelism), XENT_COMMIT (records' commit
# where the copy has no .git), DIST_DEADLINE (seconds for the whole run, default 340), CUDA_ARCHS
# (the build's architectures, default the GPU's own; 80 checks the portable tier through the
# driver's JIT, in its own build folder).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/gpu-distributed.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUILD=build-gpu
if [[ -n "${CUDA_ARCHS:-}" ]]; then
  BUILD="build-gpu-${CUDA_ARCHS//;/-}"
  # Kernels without code for this GPU are compiled by the driver at their first launch: keep them.
  export CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-4294967296}"
fi
JOBS="${JOBS:-$(nproc)}"
NPROC="${NPROC:-2}"
DEADLINE="${DIST_DEADLINE:-340}"
export PATH="$PATH:/usr/local/cuda/bin"
# NVLink multicast (NVLS) stays off on these machines: NCCL, symmetric memory and NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[[ -n "${XENT_COMMIT:-}" ]] || export XENT_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
# shellcheck source=scripts/steps.sh
source scripts/steps.sh
STEP_DEADLINE="$DEADLINE" STEP_DEADLINE_NAME="DIST_DEADLINE=$DEADLINE"
finish() {
  echo
  echo "== dist.json (rank 0) =="
  sed -n '/^op /,$p' "$OUT/torchrun.log" 2>/dev/null || echo "(no timings)"
  echo
  echo "== gpu-distributed summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) x $NPROC) =="
  print_summary
  exit $?
}

nvidia-smi >"$OUT/nvidia-smi.log" 2>&1 || true
configure() {
  local cc arch
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d .)"
  arch="${CUDA_ARCHS:-${cc:-90}}"
  [[ "$arch" == 90 ]] && arch=90a
  cmake -S . -B "$BUILD" -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=Release -DXENT_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DXENT_PYTHON=ON -DPython3_EXECUTABLE=python3
}
step configure 200 bash -c "$(declare -f configure); BUILD=$BUILD CUDA_ARCHS=${CUDA_ARCHS:-} configure" || finish
step build 200 cmake --build "$BUILD" -j "$JOBS" --target xent_torch || finish
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
step torchrun 240 python3 -m torch.distributed.run --standalone --nproc_per_node "$NPROC" tests/python/dist_check.py \
  --json "$OUT/dist.json"
# The sharded gtests on CUDA (same sources as the CPU suite), when the time allows.
if step build-tests 120 cmake --build "$BUILD" -j "$JOBS" --target xent_gpu_tests; then
  step gtest 60 "$BUILD/tests/cpp/xent_gpu_tests" --gtest_filter='*Shard*' --gtest_brief=1
fi
finish
