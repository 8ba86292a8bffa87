#!/usr/bin/env bash
# A/B of the row kernels' tuning knobs in one process run each, on the PERF.md ce shapes:
# every configuration is timed by xent-bench with its own copy-bandwidth ceiling, so the ratios
# compare within a run. Usage: scripts/row-kernel-ab.sh OUTDIR [XENT_BENCH]
#   ROW_AB_CONFIGS: space-separated configurations, each "name:VAR=value,VAR=value" (default:
#   the single-buffer kernel against the persistent double-buffered one at three slice sizes).
#   ROW_AB_SHAPES: "N:V ..." (default the PERF.md ce rows); ROW_AB_ARGS: extra xent-bench flags.
set -uo pipefail
OUT="${1:?usage: scripts/row-kernel-ab.sh OUTDIR [XENT_BENCH]}"
BENCH="${2:-build-gpu/tools/xent-bench}"
mkdir -p "$OUT"
CONFIGS="${ROW_AB_CONFIGS:-single:XENT_CUDA_ROW_BUFFERS=1 double64k:XENT_CUDA_SLICE_BYTES=65536 double48k:XENT_CUDA_SLICE_BYTES=49152 double32k:XENT_CUDA_SLICE_BYTES=32768}"
SHAPES="${ROW_AB_SHAPES:-16384:32768 16384:131072 16384:262144}"
ARGS="${ROW_AB_ARGS:---op ce --no-naive --repeat 20}"
for config in $CONFIGS; do
  name="${config%%:*}"
  vars="${config#*:}"
  for shape in $SHAPES; do
    n="${shape%%:*}"
    v="${shape#*:}"
    # shellcheck disable=SC2086
    env ${vars//,/ } "$BENCH" $ARGS --n "$n" --v "$v" --json "$OUT/$name-$n-$v.json" \
      >"$OUT/$name-$n-$v.log" 2>&1
    printf '%-12s %6s x %-7s %s\n' "$name" "$n" "$v" \
      "$(awk '$1 !~ /^\[/ && / xent / { print "median " $(NF-6) " ms, ratio " $(NF-2); exit }' "$OUT/$name-$n-$v.log")"
  done
done
