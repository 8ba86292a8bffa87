#!/usr/bin/env bash
# Runs the Python GPU tests (`pytest -m gpu`) as PARTS processes side by side, the test files dealt
# round-robin, as scripts/gtest-shards.sh does for the C++ suite: their float64 references are
# CPU-bound, so one process leaves the GPU and the other cores waiting. With SHARD_GPUS=G (a
# machine with G GPUs) part K runs on GPU K mod G. The files that start several ranks themselves
# (test_dtensor.py, *distributed*.py) run afterwards in one process that sees every GPU.
#
#   scripts/pytest-shards.sh [PARTS] [LOGDIR] [PYTEST ARGS...]
#
# PARTS defaults to 4 (at most the cores); part K's output goes to LOGDIR/part-K.log, the
# multi-rank files' to LOGDIR/ranks.log (LOGDIR default: a temporary folder). Prints each part's
# summary line and every failed test; exits 1 when a part failed, crashed or ran no test.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
parts="${1:-4}"
logs="${2:-$(mktemp -d)}"
shift $(($# < 2 ? $# : 2))
cores=$(nproc)
((parts > cores)) && parts=$cores
((parts < 1)) && parts=1
mkdir -p "$logs"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
mapfile -t all < <(ls tests/python/test_*.py)
single=() ranks=()
for file in "${all[@]}"; do
  case "$file" in
    */test_dtensor.py | *distributed*.py) ranks+=("$file") ;;
    *) single+=("$file") ;;
  esac
done
pids=()
for ((k = 0; k < parts; ++k)); do
  mine=()
  for ((i = k; i < ${#single[@]}; i += parts)); do mine+=("${single[$i]}"); done
  (
    if [[ -n "${SHARD_GPUS:-}" ]]; then export CUDA_VISIBLE_DEVICES=$((k % SHARD_GPUS)); fi
    exec python3 -m pytest -q -p no:cacheprovider -m gpu "$@" "${mine[@]}"
  ) >"$logs/part-$k.log" 2>&1 &
  pids+=($!)
done
status=0
for ((k = 0; k < parts; ++k)); do
  wait "${pids[$k]}"
  rc=$?
  # pytest exits 5 when it collected nothing: a part with only CPU tests, which is not a failure
  # of the part, but counts as no test run for the total below.
  ((rc != 0 && rc != 5)) && status=1
  echo "part $k of $parts: exit $rc, $(tail -n 1 "$logs/part-$k.log")"
done
python3 -m pytest -q -p no:cacheprovider -m gpu "$@" "${ranks[@]}" >"$logs/ranks.log" 2>&1
rc=$?
((rc != 0 && rc != 5)) && status=1
echo "multi-rank files: exit $rc, $(tail -n 1 "$logs/ranks.log")"
grep -h '^FAILED\|^ERROR' "$logs"/part-*.log "$logs/ranks.log" | sort -u
if ! grep -q ' passed' "$logs"/part-*.log "$logs/ranks.log"; then
  echo "pytest-shards: no test passed" >&2
  status=1
fi
echo "pytest-shards: $([[ $status == 0 ]] && echo passed || echo FAILED) (logs in $logs)"
exit $status
