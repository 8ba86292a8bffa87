#!/usr/bin/env bash
# ncu profile of every docs/performance.md row: for each row, ONE call of the op (after a first, unprofiled
# call) under `ncu --clock-control none`, all of its kernels kept (pre-pass, row kernel, reduce;
# cuBLASLt GEMMs and block gradients of the fused linear ops), then tools/ncu_summary.py turns
# the captures into OUTDIR/profile.json (one record per row) and OUTDIR/profile.md (one line per
# row: the dominant kernel's figures and each kernel's share of the time).
#
# Usage: scripts/gpu-profile.sh OUTDIR [ROWS]
#   ROWS: comma list of row ids or shell patterns (default: every row), e.g.
#         "ce-32k,ce-32k-nograd,distill-forward_kl-4k,linear-*"; `scripts/gpu-profile.sh --list`
#         prints the ids.
# Environment:
#   XENT_BENCH   xent-bench to run (default build-gpu/tools/xent-bench; built with the configure
#                of scripts/gpu-check.sh when missing)
#   NCU          ncu binary (default: ncu on PATH, else the newest under /usr/local/cuda*/ and
#                /opt/nvidia/nsight-compute/)
#   PROFILE_ROW_TIMEOUT  seconds per row before it is cut (default 900)
#   XENT_COMMIT  commit named in the records where the tree has no .git
#   PROFILE_PACK=0         leave the per-row files loose instead of packing them (see the end)
#   PROFILE_KEEP_REPORTS=1 keep the .ncu-rep reports (in the archive, or loose)
#   PROFILE_METRICS=time   only each launch's duration and shape (one replay per kernel, no
#                          sections): where a call's time goes, for calls of hundreds of launches
# Per row the run writes ROW.ncu-rep (open in the Nsight Compute UI), ROW.csv (`ncu --import
# ROW.ncu-rep --csv --page raw`), ROW.log (ncu and xent-bench output, with xent-bench's own
# timing of the row under ncu) and ROW.bench.json; rows.tsv lists what ran, with exit status and
# seconds. By default these end in OUTDIR/captures.tar.gz, beside profile.json and profile.md.
# Time per row measured on an H200 (ncu 2025.3, wall time of the row including process start):
# ce 16384 x 32768 4 s, distill forward_kl 4096 x 32768 5 s, linear_ce 8192 x 4096 x 128256 26 s
# (38 kernel launches; ncu replays every kernel once per pass, 20 passes for the ce kernels).
#
# How one op call is isolated: xent-bench --profile-one-call makes one extra call per case
# between cudaProfilerStart and cudaProfilerStop, and ncu runs with --profile-from-start off, so
# the random fills, the copy-bandwidth and GEMM-floor measurements, the first call and the timed
# repetitions are never profiled. ncu replays each kernel of that call once per metric pass and
# restores memory between passes; caches are flushed before each pass (--cache-control all, the
# default), so no kernel finds its inputs in L2 from the call before.
set -uo pipefail
cd "$(dirname "$0")/.."

# id|label|xent-bench flags of the case (bf16; fwdbwd unless --mode fwd)
ROWS_TABLE=()
for v in 32768 131072 262144; do
  k=$((v / 1024))k
  ROWS_TABLE+=("ce-$k|perf-ce|--op ce --n 16384 --v $v")
  ROWS_TABLE+=("ce-$k-nograd|perf-ce no grad|--op ce --n 16384 --v $v --mode fwd")
  ROWS_TABLE+=("ce-$k-all|perf-ce every option|--op ce --n 16384 --v $v --options all")
done
ROWS_TABLE+=("ce-smallV|perf-ce small V|--op ce --n 262144 --v 4096")
ROWS_TABLE+=("ce-smallN-256|perf-ce small N|--op ce --n 256 --v 262144")
ROWS_TABLE+=("ce-smallN-128|perf-ce small N|--op ce --n 128 --v 131072")
for kind in forward_kl reverse_kl jsd soft_ce tvd; do
  ROWS_TABLE+=("distill-$kind-4k|perf-distill|--op distill --kind $kind --n 4096 --v 32768")
  ROWS_TABLE+=("distill-$kind-16k|perf-distill|--op distill --kind $kind --n 16384 --v 131072")
done
ROWS_TABLE+=("linear-8192x4096x128256|perf-linear|--op linear_ce --n 8192 --h 4096 --v 128256")
ROWS_TABLE+=("linear-8192x2304x256000|perf-linear|--op linear_ce --n 8192 --h 2304 --v 256000")
ROWS_TABLE+=("linear-32768x768x128256|perf-linear|--op linear_ce --n 32768 --h 768 --v 128256")
ROWS_TABLE+=("linear-budget128|perf-linear budget 128 MiB|--op linear_ce --n 8192 --h 4096 --v 128256 --budget-mib 128")
for shape in "8192 4096 128256" "8192 2304 256000" "32768 768 128256"; do
  read -r n h v <<<"$shape"
  ROWS_TABLE+=("linear-64mib-${n}x${h}x${v}|perf-linear 64 MiB|--op linear_ce --n $n --h $h --v $v --budget-mib 64")
  # The budget the Python package gives by default on a GPU of 80 GiB or more (min(4 GiB, total / 8)).
  ROWS_TABLE+=("linear-4gib-${n}x${h}x${v}|perf-linear 4 GiB|--op linear_ce --n $n --h $h --v $v --budget-mib 4096")
  # Reduction none: the forward's fused statistics, then the backward's chunk gradients formed
  # by the fused gradient product from the saved lse (no logits written, no row kernel).
  ROWS_TABLE+=("linear-4gib-none-${n}x${h}x${v}|perf-linear 4 GiB none|--op linear_ce --n $n --h $h --v $v --budget-mib 4096 --reduction none")
done
for shape in "8192 4096 128256" "8192 2304 256000" "32768 768 128256"; do
  read -r n h v <<<"$shape"
  # linear_distill (forward KL, the teacher as hidden states): statistics block by block at 64 MiB,
  # the accumulator schedule at 4 GiB.
  ROWS_TABLE+=("linear-distill-64mib-${n}x${h}x${v}|perf-linear distill 64 MiB|--op linear_distill --kind forward_kl --n $n --h $h --v $v --budget-mib 64")
  ROWS_TABLE+=("linear-distill-4gib-${n}x${h}x${v}|perf-linear distill 4 GiB|--op linear_distill --kind forward_kl --n $n --h $h --v $v --budget-mib 4096")
done
ROWS_TABLE+=("linear-options|perf-linear z-loss smoothing softcap|--op linear_ce --n 8192 --h 4096 --v 128256 --options smoothing,z_loss,softcap")

if [[ "${1:-}" == "--list" ]]; then
  for entry in "${ROWS_TABLE[@]}"; do printf '%-28s %s\n' "${entry%%|*}" "${entry##*|}"; done
  exit 0
fi
OUT="${1:?usage: scripts/gpu-profile.sh OUTDIR [ROWS]   (--list for the row ids)}"
SELECT="${2:-*}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PATH="$PATH:/usr/local/cuda/bin"
BENCH="${XENT_BENCH:-build-gpu/tools/xent-bench}"
ROW_TIMEOUT="${PROFILE_ROW_TIMEOUT:-900}"

find_ncu() {
  if [[ -n "${NCU:-}" ]]; then echo "$NCU"; return; fi
  command -v ncu 2>/dev/null && return
  ls -d /usr/local/cuda*/bin/ncu /usr/local/cuda*/nsight-compute*/ncu \
    /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -V | tail -n 1
}
NCU="$(find_ncu)"
if [[ -z "$NCU" || ! -x "$NCU" ]]; then
  echo "gpu-profile: ncu not found (set NCU=/path/to/ncu)" >&2
  exit 1
fi
"$NCU" --version >"$OUT/ncu-version.log" 2>&1
NCU_VERSION="$(grep -Eo '[0-9]{4}\.[0-9]+\.[0-9.]+' "$OUT/ncu-version.log" | head -n 1)"

if [[ ! -x "$BENCH" ]]; then
  # The configure of scripts/gpu-check.sh (Hopper: sm_90a).
  echo "gpu-profile: $BENCH missing; building build-gpu/tools/xent-bench" >&2
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d .)"
  arch="${cc:-90}"
  [[ "$arch" == 90 ]] && arch=90a
  cmake -S . -B build-gpu -G Ninja -Wno-dev -DCMAKE_BUILD_TYPE=Release -DXENT_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" >"$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j "${JOBS:-$(nproc)}" --target xent-bench >>"$OUT/build.log" 2>&1 ||
    { echo "gpu-profile: build failed, see $OUT/build.log" >&2; exit 1; }
  BENCH=build-gpu/tools/xent-bench
fi
COMMIT="${XENT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"

# Sections for the figures of the record (duration, DRAM and SM throughput, issue rate,
# occupancy and its limits, launch shape, memory traffic, pipe use, stall reasons) plus raw
# metrics no section reports on its own. A metric this GPU or ncu does not know would fail the
# whole capture, so the extras are kept only when `ncu --query-metrics` lists them.
SECTIONS=(SpeedOfLight Occupancy SchedulerStats LaunchStats MemoryWorkloadAnalysis
          ComputeWorkloadAnalysis WarpStateStats)
EXTRA_METRICS=(dram__bytes_read.sum dram__bytes_write.sum dram__bytes_read.sum.per_second
               dram__bytes_write.sum.per_second smsp__inst_executed.sum
               smsp__thread_inst_executed.sum sm__inst_executed_pipe_xu.sum
               sm__inst_executed_pipe_fma.sum sm__cycles_elapsed.avg.per_second
               sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
               sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active)
"$NCU" --query-metrics >"$OUT/ncu-query-metrics.log" 2>&1
if [[ "${PROFILE_METRICS:-all}" == time ]]; then
  SECTIONS=()
  EXTRA_METRICS=(gpu__time_duration.sum launch__grid_size launch__block_size)
fi
METRICS=()
for metric in "${EXTRA_METRICS[@]}"; do
  if grep -Eq "(^|[^a-z0-9_])${metric%%.*}([^a-z0-9_]|$)" "$OUT/ncu-query-metrics.log"; then
    METRICS+=("$metric")
  else
    echo "gpu-profile: $metric not listed by ncu --query-metrics; not collected" >&2
  fi
done
NCU_ARGS=(--profile-from-start off --clock-control none --target-processes all)
"$NCU" --list-sections >"$OUT/ncu-list-sections.log" 2>&1
for section in "${SECTIONS[@]}"; do
  if grep -Eq "(^|[^A-Za-z])${section}([^A-Za-z]|$)" "$OUT/ncu-list-sections.log"; then
    NCU_ARGS+=(--section "$section")
  else
    echo "gpu-profile: section $section not listed by ncu --list-sections; not collected" >&2
  fi
done
if ((${#METRICS[@]})); then NCU_ARGS+=(--metrics "$(IFS=,; echo "${METRICS[*]}")"); fi

selected() {
  local id="$1" pattern
  IFS=, read -ra patterns <<<"$SELECT"
  for pattern in "${patterns[@]}"; do
    # shellcheck disable=SC2053  # the pattern is a glob on purpose
    [[ "$id" == $pattern ]] && return 0
  done
  return 1
}
flag() {  # flag NAME ARGS...: the value after --NAME in ARGS, or empty
  local name="$1"
  shift
  while (($#)); do
    [[ "$1" == "--$name" ]] && { echo "${2:-}"; return; }
    shift
  done
}

printf 'row\tlabel\top\tmode\toptions\tkind\tn\th\tv\tbudget_mib\tstatus\tseconds\tcsv\tcommit\tncu_version\n' \
  >"$OUT/rows.tsv"
echo "gpu-profile: $NCU ($NCU_VERSION), $BENCH, rows '$SELECT' -> $OUT" >&2
failed=0
for entry in "${ROWS_TABLE[@]}"; do
  IFS='|' read -r id label args <<<"$entry"
  selected "$id" || continue
  read -ra bench_args <<<"$args"
  start=$SECONDS
  rm -f "$OUT/$id.ncu-rep" "$OUT/$id.csv"
  timeout --kill-after=20 "$ROW_TIMEOUT" "$NCU" "${NCU_ARGS[@]}" --export "$OUT/$id" \
    --force-overwrite "$BENCH" --device cuda --no-naive --repeat 1 --warmup 0 \
    --profile-one-call --json "$OUT/$id.bench.json" "${bench_args[@]}" >"$OUT/$id.log" 2>&1
  status=$?
  if [[ -f "$OUT/$id.ncu-rep" ]]; then
    # Base units (ns, byte/second) where this ncu can print them; the parser converts either way.
    "$NCU" --import "$OUT/$id.ncu-rep" --csv --page raw --print-units base >"$OUT/$id.csv" \
      2>>"$OUT/$id.log" ||
      "$NCU" --import "$OUT/$id.ncu-rep" --csv --page raw >"$OUT/$id.csv" 2>>"$OUT/$id.log"
  fi
  [[ $status -eq 0 && -s "$OUT/$id.csv" ]] || failed=1
  seconds=$((SECONDS - start))
  mode="$(flag mode "${bench_args[@]}")"
  options="$(flag options "${bench_args[@]}")"
  budget="$(flag budget-mib "${bench_args[@]}")"
  h="$(flag h "${bench_args[@]}")"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$label" \
    "$(flag op "${bench_args[@]}")" "${mode:-fwdbwd}" "${options:-plain}" \
    "$(flag kind "${bench_args[@]}")" "$(flag n "${bench_args[@]}")" "${h:-0}" \
    "$(flag v "${bench_args[@]}")" "${budget:-512}" "$status" "$seconds" "$id.csv" "$COMMIT" \
    "$NCU_VERSION" >>"$OUT/rows.tsv"
  echo "gpu-profile: $id: exit $status, ${seconds}s, $(grep -c '' "$OUT/$id.csv" 2>/dev/null || echo 0) CSV lines" >&2
done

python3 tools/ncu_summary.py "$OUT" --json "$OUT/profile.json" --markdown >"$OUT/profile.md" ||
  failed=1
cat "$OUT/profile.md"

# Few files out: the captures go into one archive next to profile.json, profile.md and rows.tsv
# (a machine that hands back only a handful of files still returns everything). The .ncu-rep
# reports (2-10 MB each) go in only with PROFILE_KEEP_REPORTS=1; PROFILE_PACK=0 leaves every
# file loose.
if [[ "${PROFILE_PACK:-1}" == 1 ]]; then
  (
    cd "$OUT" || exit 1
    files=(ncu-*.log build.log)
    for entry in "${ROWS_TABLE[@]}"; do
      id="${entry%%|*}"
      files+=("$id.csv" "$id.log" "$id.bench.json")
      [[ "${PROFILE_KEEP_REPORTS:-0}" == 1 ]] && files+=("$id.ncu-rep")
    done
    present=()
    for f in "${files[@]}"; do [[ -f "$f" ]] && present+=("$f"); done
    tar -czf captures.tar.gz "${present[@]}" && rm -f "${present[@]}" ./*.ncu-rep
  ) || failed=1
fi
exit $failed
