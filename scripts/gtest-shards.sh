#!/usr/bin/env bash
# Runs a googletest binary's tests as SHARDS processes side by side (GTEST_TOTAL_SHARDS /
# GTEST_SHARD_INDEX). The GPU suites spend most of their time in float64 references on the CPU,
# so shards sharing one GPU finish several times sooner: 1084 linear_ce tests took 73 s in eight
# shards where one process had not finished them in 200 s (docs/archive/perf-notes.md, decision 114).
#
#   scripts/gtest-shards.sh BINARY FILTER [SHARDS] [LOGDIR]
#
# SHARDS defaults to 8 (at most the cores); each shard's output goes to LOGDIR/shard-K.log
# (default: a temporary folder). Prints one line per shard and every failed test; exits 1 when a
# shard failed, crashed or ran no test. With SHARD_GPUS=G in the environment (a machine with G
# GPUs), shard K runs on GPU K mod G (CUDA_VISIBLE_DEVICES); otherwise every shard sees the GPUs
# the caller does.
set -uo pipefail
binary="${1:?usage: scripts/gtest-shards.sh BINARY FILTER [SHARDS] [LOGDIR]}"
filter="${2:?usage: scripts/gtest-shards.sh BINARY FILTER [SHARDS] [LOGDIR]}"
shards="${3:-8}"
logs="${4:-$(mktemp -d)}"
cores=$(nproc)
((shards > cores)) && shards=$cores
((shards < 1)) && shards=1
mkdir -p "$logs"
pids=()
for ((k = 0; k < shards; ++k)); do
  if [[ -n "${SHARD_GPUS:-}" ]]; then
    export CUDA_VISIBLE_DEVICES=$((k % SHARD_GPUS))
  fi
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$k "$binary" --gtest_filter="$filter" \
    --gtest_brief=1 >"$logs/shard-$k.log" 2>&1 &
  pids+=($!)
done
status=0 ran=0
for ((k = 0; k < shards; ++k)); do
  wait "${pids[$k]}"
  rc=$?
  # "[==========] N tests from M test suites ran." is printed by every shard that finished.
  count=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$logs/shard-$k.log")
  echo "shard $k of $shards: exit $rc, ${count:-no} tests ran"
  ((rc != 0)) && status=1
  ran=$((ran + ${count:-0}))
done
grep -h '^\[  FAILED  \] [A-Za-z]' "$logs"/shard-*.log | sort -u
if ((ran == 0)); then
  echo "gtest-shards: no test matched '$filter'" >&2
  status=1
fi
echo "gtest-shards: $ran tests in $shards shards, $([[ $status == 0 ]] && echo passed || echo FAILED) (logs in $logs)"
exit $status
