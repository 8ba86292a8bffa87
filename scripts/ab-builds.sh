#!/usr/bin/env bash
# Times two builds of xent on one GPU, interleaved, so that a refactoring or a kernel change is
# judged against the spread of the same run: xent-bench's suites (the kernels) and
# tools/compare_torch.py with impl xent_torch (the package through autograd), ROUNDS rounds each,
# base and new alternating. Each tree must hold a GPU build: BUILD/tools/xent-bench and
# python/xent/_C.so (scripts/gpu-check.sh makes both).
#
#   scripts/ab-builds.sh BASE_TREE NEW_TREE OUTDIR [ROUNDS]
#
# Environment: AB_BUILD (default build-gpu), AB_BENCH_SUITES (default "perf-ce perf-distill
# perf-linear"), AB_TORCH_SUITES (default "perf-linear"), AB_TORCH_ARGS (more arguments of
# compare_torch.py, e.g. "--labels 'perf-linear$'"). Writes OUTDIR/{base,new}-bench-S-R.json
# and OUTDIR/{base,new}-torch-S-R.json, then prints one line per case: median ms of each side per
# round, and new/base.
set -uo pipefail
base="$(cd "${1:?usage: scripts/ab-builds.sh BASE_TREE NEW_TREE OUTDIR [ROUNDS]}" && pwd)"
new="$(cd "${2:?}" && pwd)"
out="${3:?}"
rounds="${4:-2}"
build="${AB_BUILD:-build-gpu}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
tools="$(cd "$(dirname "$0")/../tools" && pwd)"  # the comparison script of this tree, for both

for ((round = 1; round <= rounds; round++)); do
  for side in base new; do
    tree=$base
    [[ $side == new ]] && tree=$new
    for suite in ${AB_BENCH_SUITES:-perf-ce perf-distill perf-linear}; do
      echo "[ab] round $round $side xent-bench $suite" >&2
      "$tree/$build/tools/xent-bench" --suite "$suite" --device cuda \
        --json "$out/$side-bench-$suite-$round.json" >"$out/$side-bench-$suite-$round.log" 2>&1 ||
        echo "[ab] $side xent-bench $suite failed (see its log)" >&2
    done
    for suite in ${AB_TORCH_SUITES:-perf-linear}; do
      echo "[ab] round $round $side compare_torch $suite" >&2
      PYTHONPATH="$tree/python" python3 "$tools/compare_torch.py" --suite "$suite" \
        --impls xent_torch ${AB_TORCH_ARGS:-} --json "$out/$side-torch-$suite-$round.json" \
        >"$out/$side-torch-$suite-$round.log" 2>&1 ||
        echo "[ab] $side compare_torch $suite failed (see its log)" >&2
    done
  done
done

python3 - "$out" <<'PY'
import collections, glob, json, os, re, statistics, sys
out = sys.argv[1]
times = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    side = os.path.basename(path).split("-")[0]
    try:
        records = json.load(open(path))
    except (OSError, ValueError):
        continue
    for r in records:
        t = r.get("time_ms") or r.get("time") or {}
        median = t.get("median") if isinstance(t, dict) else None
        if median is None:
            median = r.get("median_ms")
        if median is None:
            continue
        key = " ".join(str(r.get(k, "")) for k in ("impl", "label", "op", "mode", "options", "reduction", "kind", "dtype", "weight_dtype", "n", "h", "v", "budget_bytes", "distribution"))
        times[re.sub(r"\s+", " ", key).strip()][side].append(float(median))
ratios = []
for key in sorted(times):
    sides = times[key]
    if not sides.get("base") or not sides.get("new"):
        continue
    b, n = statistics.median(sides["base"]), statistics.median(sides["new"])
    ratios.append(n / b)
    print(f"{key}: base {' '.join(f'{x:.3f}' for x in sides['base'])} ms, new "
          f"{' '.join(f'{x:.3f}' for x in sides['new'])} ms, new/base {n / b:.3f}")
if ratios:
    print(f"ab: {len(ratios)} cases, new/base median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")
PY
