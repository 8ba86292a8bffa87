#!/usr/bin/env bash
# Does the same linear_ce call cost the same in every process (docs/performance.md, "plan
# stability")? Runs PROCESSES fresh processes of compare_torch.py with xent alone and as many with
# another library's run first (BEFORE, default torch.compile of the same loss), at one shape, and
# prints xent's median per process, the spread within each group and the gap between them.
#
#   scripts/plan-stability.sh OUT_DIR [N H V]
#
# Environment: PROCESSES (5), BEFORE (compile), BUDGET_MIB (unset: the default budget),
# REPEAT (10), WARMUP (3). The package must be importable (PYTHONPATH=python from the repo root).
set -euo pipefail
out="${1:?usage: scripts/plan-stability.sh OUT_DIR [N H V]}"
n="${2:-8192}" h="${3:-2304}" v="${4:-256000}"
here="$(cd "$(dirname "$0")/.." && pwd)"
processes="${PROCESSES:-5}" before="${BEFORE:-compile}"
budget=()
[[ -n "${BUDGET_MIB:-}" ]] && budget=(--budget-mib "$BUDGET_MIB")
mkdir -p "$out"
for ((i = 1; i <= processes; i++)); do
  for group in alone after; do
    impls=xent_torch
    [[ $group == after ]] && impls="$before,xent_torch"
    python3 "$here/tools/compare_torch.py" --op linear_ce --n "$n" --h "$h" --v "$v" \
      --impls "$impls" "${budget[@]}" --repeat "${REPEAT:-10}" --warmup "${WARMUP:-3}" \
      --json "$out/$group-$i.json" >"$out/$group-$i.log" 2>&1
    echo "process $i ($group) done"
  done
done
python3 - "$out" "$before" <<'PY'
import glob, json, statistics, sys
out, before = sys.argv[1], sys.argv[2]
times = {}
for group in ("alone", "after"):
    times[group] = []
    for path in sorted(glob.glob(f"{out}/{group}-*.json")):
        for r in json.load(open(path)):
            if r["impl"] == "xent_torch" and r.get("time_ms"):
                times[group].append(r["time_ms"]["median"])
summary = {}
for group, t in times.items():
    if t:
        summary[group] = dict(medians_ms=t, spread=(max(t) - min(t)) / min(t))
        print(f"xent {group:5s} ({len(t)} processes): " + " ".join(f"{x:.2f}" for x in t)
              + f" ms, spread {100 * summary[group]['spread']:.1f} %")
if len(summary) == 2:
    gap = statistics.median(times["after"]) / statistics.median(times["alone"]) - 1
    summary["gap_after_vs_alone"] = gap
    print(f"median after {before} / median alone - 1: {100 * gap:+.1f} %")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
PY
