#!/usr/bin/env bash
# Runs the C++ test binary under many consecutive seeds (seed, seed + 1, ...: --gtest_repeat with
# a seed per iteration, tests/cpp/test_main.cpp) and reports every failing test with the seed
# that replays it: XENT_TEST_SEED=<seed> <binary> --gtest_filter=<test>.
#
#   scripts/seed-sweep.sh [-n seeds] [-s first_seed] [-f gtest_filter] [-b binary]
#                         [-c seeds_per_process] [-l log]
#
# Defaults: 100 seeds from a random first one, every test, build-cpu/tests/cpp/xent_tests, 25
# seeds per process (a crash loses at most those), log in a temporary file. Runs nice'd, with
# OMP_NUM_THREADS=1 unless set (the suites' problems are below the op's parallel threshold), at
# niceness SWEEP_NICE (default 19).
# Prints one line per process and a summary; exits 1 when any test failed.
set -euo pipefail

seeds=100
first=$(( $(od -An -N4 -tu4 /dev/urandom) % 1000000000 ))
filter='*'
binary=build-cpu/tests/cpp/xent_tests
chunk=25
log=""
while getopts "n:s:f:b:c:l:" option; do
  case $option in
    n) seeds=$OPTARG ;;
    s) first=$OPTARG ;;
    f) filter=$OPTARG ;;
    b) binary=$OPTARG ;;
    c) chunk=$OPTARG ;;
    l) log=$OPTARG ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
  esac
done
[[ -n $log ]] || log=$(mktemp /tmp/seed-sweep.XXXXXX)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "seed sweep: $binary --gtest_filter='$filter', seeds $first..$(( first + seeds - 1 )), log $log"
: > "$log"
done_seeds=0 tests_run=0 failed=0 crashes=0
started=$(date +%s)
while (( done_seeds < seeds )); do
  count=$(( seeds - done_seeds < chunk ? seeds - done_seeds : chunk ))
  start=$(( first + done_seeds ))
  output=$(mktemp /tmp/seed-sweep-part.XXXXXX)
  status=0
  nice -n "${SWEEP_NICE:-19}" "$binary" --gtest_filter="$filter" --gtest_repeat="$count" --gtest_brief=1 \
    --seed="$start" > "$output" 2>&1 || status=$?
  cat "$output" >> "$log"
  # Iterations that finished ("N tests ... ran"), and the failing tests of each, by seed.
  finished=$(grep -c '^\[==========\] .* ran\.' "$output" || true)
  ran=$(awk '/^\[==========\] .* ran\./ { total += $2 } END { print total + 0 }' "$output")
  failures=$(awk '
    /^xent tests: .*XENT_TEST_SEED=/ {
      split($0, part, "XENT_TEST_SEED="); split(part[2], word, " "); seed = word[1] }
    /^\[  FAILED  \] [^ ]+( \(|, where)/ {
      name = $4; sub(/,$/, "", name); print "FAILED XENT_TEST_SEED=" seed " " name }' "$output" | sort -u)
  rm -f "$output"
  tests_run=$(( tests_run + ran ))
  if [[ -n $failures ]]; then
    echo "$failures"
    failed=$(( failed + $(wc -l <<< "$failures") ))
  fi
  if (( finished < count )); then
    echo "CRASH: the process for seeds $start..$(( start + count - 1 )) stopped after $finished" \
         "iterations (exit status $status); see $log"
    crashes=$(( crashes + 1 ))
  fi
  done_seeds=$(( done_seeds + count ))
  echo "seeds $start..$(( start + count - 1 )): $ran tests run, $(( $(date +%s) - started )) s so far" \
       "($done_seeds/$seeds seeds, $failed failures)"
done
echo "seed sweep done: $done_seeds seeds, $tests_run tests run, $failed failures, $crashes crashes" \
     "(first seed $first, filter '$filter')"
(( failed == 0 && crashes == 0 ))
