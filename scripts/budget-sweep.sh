#!/usr/bin/env bash
# What the workspace budget of linear_ce (or, with OP=linear_distill, of linear_distill: forward
# KL, the teacher as hidden states and head) costs: the full step (forward and backward) through
# the Python package at the docs/performance.md shapes, one budget after another, each beside F (the op's
# products by torch.matmul, timed in the same process), with the peak extra memory of the step.
# The budgets default to each shape's fp32 ∂W accumulator + 256 MiB (issue 10's memory row),
# 1 GiB, 256 MiB and 64 MiB, and the package's own default; WEIGHTS adds an fp32 weight, plain and
# under autocast, at each budget.
#
#   scripts/budget-sweep.sh OUT.json [BUDGETS_MIB...]
#
# Environment: OP (linear_ce), SHAPES ("N,H,V N,H,V ..."; default the three docs/performance.md shapes),
# WEIGHTS ("bf16 fp32 fp32-autocast"; default bf16; linear_ce only), WARMUP (5), REPEAT (10),
# DISTRIBUTION (random; linear_ce only). The Python
# package must be importable (PYTHONPATH=python:tools from the repository root). Every record is
# appended to OUT.json; a line per step shows progress.
set -euo pipefail
out="${1:?usage: scripts/budget-sweep.sh OUT.json [BUDGETS_MIB...]}"
shift
here="$(cd "$(dirname "$0")/.." && pwd)"
shapes="${SHAPES:-8192,4096,128256 8192,2304,256000 32768,768,128256}"
op="${OP:-linear_ce}"
weights="${WEIGHTS:-bf16}"
warmup="${WARMUP:-5}" repeat="${REPEAT:-10}" distribution="${DISTRIBUTION:-random}"
for shape in $shapes; do
  IFS=, read -r n h v <<<"$shape"
  if (($# > 0)); then
    budgets="$*"
  else
    # "default": no --budget-mib, the package's device-aware default.
    accumulator=$(((v * h * 4 + (1 << 20) - 1) >> 20))
    budgets="$((accumulator + 256)) 1024 256 64 default"
  fi
  for weight in $weights; do
    for budget in $budgets; do
      args=(--op "$op" --n "$n" --h "$h" --v "$v" --mode fwdbwd --impls xent_torch
            --warmup "$warmup" --repeat "$repeat" --json "$out" --append)
      [[ "$op" == linear_ce ]] && args+=(--distribution "$distribution")
      [[ "$budget" != default ]] && args+=(--budget-mib "$budget")
      [[ "$weight" != bf16 ]] && args+=(--weight "$weight")
      echo "budget-sweep: $op N=$n H=$h V=$v budget=$budget weight=$weight" >&2
      python3 "$here/tools/compare_torch.py" "${args[@]}"
    done
  done
done
