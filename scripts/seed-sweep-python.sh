#!/usr/bin/env bash
# Runs the Python suite under many consecutive seeds (seed, seed + 1, ...), one pytest process per
# seed, and reports every failing test with the seed that replays it:
# XENT_TEST_SEED=<seed> PYTHONPATH=python python3 -m pytest -q -p no:cacheprovider <test>.
#
#   scripts/seed-sweep-python.sh [-n seeds] [-s first_seed] [-k pytest_-k_expression]
#                                [-t tests_path] [-l log_dir] [-j parallel] [-d seconds]
#
# Needs the binding built into python/xent (the Makefile's test-python: the xent_torch target of a
# preset configured with -DPython3_EXECUTABLE). Defaults: 20 seeds from a random first one, every
# test of tests/python, logs in a temporary directory (one file per failing seed). Runs nice'd at
# SWEEP_NICE (default 19) with one thread per process (OMP_NUM_THREADS, torch's intra-op pool), so
# -j P runs P seeds side by side on P cores. -d S starts no new seed after S seconds. Prints one
# line per failing seed and a summary; exits 1 when any test failed.
set -euo pipefail

seeds=20
first=$(( $(od -An -N4 -tu4 /dev/urandom) % 1000000000 ))
keyword=""
tests=tests/python
logdir=""
parallel=1
deadline=0
while getopts "n:s:k:t:l:j:d:" option; do
  case $option in
    n) seeds=$OPTARG ;;
    s) first=$OPTARG ;;
    k) keyword=$OPTARG ;;
    t) tests=$OPTARG ;;
    l) logdir=$OPTARG ;;
    j) parallel=$OPTARG ;;
    d) deadline=$OPTARG ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
  esac
done
[[ -n $logdir ]] || logdir=$(mktemp -d /tmp/seed-sweep-python.XXXXXX)
mkdir -p "$logdir"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}
started=$(date +%s)
echo "python seed sweep: $tests${keyword:+ -k '$keyword'}, seeds $first..$(( first + seeds - 1 ))," \
     "$parallel parallel, logs in $logdir"

# One seed: a line "seed S: ok|FAILED|skipped|error", the failing tests' replay lines first.
run_seed() {
  local seed=$1 log="$logdir/seed-$1.log" status=0
  if (( deadline > 0 && $(date +%s) - started >= deadline )); then
    echo "seed $seed: skipped (deadline)"; return 0
  fi
  XENT_TEST_SEED=$seed nice -n "${SWEEP_NICE:-19}" "$python" -m pytest -q -x -p no:cacheprovider \
    ${keyword:+-k "$keyword"} "$tests" > "$log" 2>&1 || status=$?
  if (( status == 0 )); then
    echo "seed $seed: ok $(grep -Eo '[0-9]+ passed' "$log" | head -1)"; rm -f "$log"; return 0
  fi
  local failures
  failures=$(grep -E '^FAILED ' "$log" | awk '{ print $2 }' || true)
  if [[ -n $failures ]]; then
    while read -r test; do
      echo "FAILED XENT_TEST_SEED=$seed PYTHONPATH=python $python -m pytest -q -p no:cacheprovider '$test'"
    done <<< "$failures"
    echo "seed $seed: FAILED (log $log)"
  else
    echo "seed $seed: error, pytest exit status $status (log $log)"
  fi
}
export -f run_seed
export logdir started deadline python keyword tests

seq "$first" $(( first + seeds - 1 )) | xargs -P "$parallel" -I{} bash -c 'run_seed {}' \
  | tee "$logdir/results"
results=$(cat "$logdir/results")
ok=$(grep -c ': ok' <<< "$results" || true)
failed=$(grep -c ': FAILED' <<< "$results" || true)
errors=$(grep -c ': error' <<< "$results" || true)
skipped=$(grep -c ': skipped' <<< "$results" || true)
echo "python seed sweep done: $(( ok + failed + errors )) seeds run, $ok passed, $failed failed," \
     "$errors errors, $skipped skipped by the deadline (first seed $first, $parallel parallel," \
     "$(( $(date +%s) - started )) s)"
(( failed == 0 && errors == 0 ))
