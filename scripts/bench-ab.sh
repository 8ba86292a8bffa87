#!/usr/bin/env bash
# A/B of tuning knobs and schedule switches, each configuration in its own xent-bench process on
# the same shapes: every run is timed with its own ceilings (copy bandwidth, cuBLASLt floor), so
# the ratios compare within a run. Usage: scripts/bench-ab.sh OUTDIR [XENT_BENCH]
#   AB_CONFIGS: space-separated configurations, each "name:VAR=value,VAR=value" ("name:" for
#   none; default: the ce row kernel's single buffer against the double-buffered one at three
#   slice sizes).
#   AB_SHAPES: "N:V ..." (ce, distill) or "N:H:V ..." (linear ops); default the PERF.md ce rows.
#   AB_ARGS: the other xent-bench flags (default "--op ce --no-naive --repeat 20").
# Every record lands in OUTDIR/ab.json (one JSON array, each record with its "ab_config" and the
# variables it ran with, "ab_env"), the logs in OUTDIR/logs/; one line per run prints as it ends.
# OUTDIR/logs/ is emptied first: ab.json holds this run's records only (a run into a used OUTDIR
# once merged an earlier run's configurations into its record).
set -uo pipefail
OUT="${1:?usage: scripts/bench-ab.sh OUTDIR [XENT_BENCH]}"
BENCH="${2:-build-gpu/tools/xent-bench}"
mkdir -p "$OUT/logs"
rm -f "$OUT"/logs/*.json "$OUT"/logs/*.env "$OUT"/logs/*.log
ROW_KERNEL_CONFIGS="single:XENT_CUDA_ROW_BUFFERS=1 double64k:XENT_CUDA_SLICE_BYTES=65536
  double48k:XENT_CUDA_SLICE_BYTES=49152 double32k:XENT_CUDA_SLICE_BYTES=32768"
CONFIGS="${AB_CONFIGS:-${ROW_AB_CONFIGS:-$ROW_KERNEL_CONFIGS}}"
SHAPES="${AB_SHAPES:-${ROW_AB_SHAPES:-16384:32768 16384:131072 16384:262144}}"
ARGS="${AB_ARGS:-${ROW_AB_ARGS:---op ce --no-naive --repeat 20}}"
for config in $CONFIGS; do
  name="${config%%:*}"
  vars="${config#*:}"
  for shape in $SHAPES; do
    IFS=: read -r -a dims <<<"$shape"
    if [[ ${#dims[@]} -eq 3 ]]; then
      size=(--n "${dims[0]}" --h "${dims[1]}" --v "${dims[2]}")
    else
      size=(--n "${dims[0]}" --v "${dims[1]}")
    fi
    tag="$name-${shape//:/-}"
    printf '%s\n' "${vars//,/ }" >"$OUT/logs/$tag.env"
    # shellcheck disable=SC2086
    env ${vars//,/ } "$BENCH" $ARGS "${size[@]}" --json "$OUT/logs/$tag.json" \
      >"$OUT/logs/$tag.log" 2>&1
    printf '%-14s %-20s %s\n' "$name" "$shape" \
      "$(awk '$1 !~ /^\[/ && / xent / { print "median " $(NF-6) " ms, ratio " $(NF-2); exit }' \
        "$OUT/logs/$tag.log")"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
records = []
for path in sorted(glob.glob(os.path.join(out, "logs", "*.json"))):
    try:
        for record in json.load(open(path)):
            record["ab_config"] = os.path.basename(path)[: -len(".json")]
            env = path[: -len(".json")] + ".env"
            if os.path.exists(env):
                record["ab_env"] = open(env).read().strip()
            records.append(record)
    except (OSError, ValueError) as error:
        print(f"{path}: {error}", file=sys.stderr)
json.dump(records, open(os.path.join(out, "ab.json"), "w"), indent=1)
PY
