#!/usr/bin/env bash
# Runs the C++ test binary under many consecutive seeds (seed, seed + 1, ...: --gtest_repeat with
# a seed per iteration, tests/cpp/test_main.cpp) and reports every failing test with the seed
# that replays it: XENT_TEST_SEED=<seed> <binary> --gtest_filter=<test>.
#
#   scripts/seed-sweep.sh [-n seeds] [-s first_seed] [-f gtest_filter] [-b binary]
#                         [-c seeds_per_process] [-l log] [-j parallel] [-d seconds]
#
# Defaults: 100 seeds from a random first one, every test, build-cpu/tests/cpp/xent_tests, 25
# seeds per process (a crash loses at most those), log in a temporary file. Runs nice'd, with
# OMP_NUM_THREADS=1 unless set (the suites' problems are below the op's parallel threshold), at
# niceness SWEEP_NICE (default 19). -j P splits the seeds into P consecutive ranges swept side by
# side (one core each; logs LOG.1 ... LOG.P, then merged into LOG). -d S starts no new process
# after S seconds, so a sweep fits a time slot: the summary then says how many seeds it covered.
# Prints one line per process and a summary; exits 1 when any test failed.
set -euo pipefail

seeds=100
first=$(( $(od -An -N4 -tu4 /dev/urandom) % 1000000000 ))
filter='*'
binary=build-cpu/tests/cpp/xent_tests
chunk=25
log=""
parallel=1
deadline=0
while getopts "n:s:f:b:c:l:j:d:" option; do
  case $option in
    n) seeds=$OPTARG ;;
    s) first=$OPTARG ;;
    f) filter=$OPTARG ;;
    b) binary=$OPTARG ;;
    c) chunk=$OPTARG ;;
    l) log=$OPTARG ;;
    j) parallel=$OPTARG ;;
    d) deadline=$OPTARG ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
  esac
done
[[ -n $log ]] || log=$(mktemp /tmp/seed-sweep.XXXXXX)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The products of the linear suites would otherwise start a BLAS thread per core in every process,
# and those threads spin in sched_yield (a fifth of a single sweep's time, measured with perf).
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}

if (( parallel > 1 )); then
  # P sweeps of consecutive ranges; each prints its own lines (prefixed) and summary.
  pids=()
  for (( part = 0; part < parallel; part++ )); do
    part_first=$(( first + part * seeds / parallel ))
    part_seeds=$(( first + (part + 1) * seeds / parallel - part_first ))
    "$0" -n "$part_seeds" -s "$part_first" -f "$filter" -b "$binary" -c "$chunk" \
      -l "$log.$(( part + 1 ))" -d "$deadline" 2>&1 | sed "s/^/[$(( part + 1 ))] /" &
    pids+=($!)
  done
  wait "${pids[@]}"
  for (( part = 1; part <= parallel; part++ )); do cat "$log.$part"; done > "$log"
  # The merged summary: every part's "seed sweep done" line, summed.
  grep -h "seed sweep done:" "$log".[0-9]*.summary 2>/dev/null | awk -v first="$first" -v filter="$filter" '
    { seeds += $4; tests += $6; failed += $9; crashes += $11 }
    END {
      printf "seed sweep done: %d seeds, %d tests run, %d failures, %d crashes (first seed %d, " \
             "filter \x27%s\x27, %d parallel sweeps)\n", seeds, tests, failed, crashes, first, filter, NR
      exit (failed == 0 && crashes == 0) ? 0 : 1 }'
  exit $?
fi

echo "seed sweep: $binary --gtest_filter='$filter', seeds $first..$(( first + seeds - 1 )), log $log"
: > "$log"
done_seeds=0 tests_run=0 failed=0 crashes=0
started=$(date +%s)
while (( done_seeds < seeds )); do
  if (( deadline > 0 && $(date +%s) - started >= deadline )); then
    echo "deadline of $deadline s reached: stopping after $done_seeds of $seeds seeds"
    break
  fi
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
     "(first seed $first, filter '$filter')" | tee "$log.summary"
(( failed == 0 && crashes == 0 ))
