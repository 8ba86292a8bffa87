# The step runner of the GPU scripts (gpu-check.sh, gpu-distributed.sh), sourced by both.
#   step NAME LIMIT_SECONDS COMMAND...   runs COMMAND with a time limit, its output in
#                                        $OUT/NAME.log, and adds one line to SUMMARY.
# STEP_SKIP (",name,name,") skips steps by name (status 0); STEP_DEADLINE (seconds from the start of
# the script, empty for none) cuts every step's limit so the summary always prints, and a step
# with no time left is skipped with status 1. STEP_SKIP_NAME and STEP_DEADLINE_NAME name the
# settings in the summary lines.
SUMMARY=()

summary_line() {  # NAME STATUS TIME NOTE
  SUMMARY+=("$(printf '%-12s %-6s %6s  %s' "$@")")
}
note_skip() { summary_line "$1" SKIP - "$2"; }
step_skipped() { [[ ",${STEP_SKIP:-}," == *",$1,"* ]]; }

step() {
  local name="$1" limit="$2"
  shift 2
  if step_skipped "$name"; then
    note_skip "$name" "${STEP_SKIP_NAME:-skipped by name}"
    return 0
  fi
  if [[ -n "${STEP_DEADLINE:-}" ]]; then
    local left=$((STEP_DEADLINE - SECONDS - 20))
    if ((left < 5)); then
      note_skip "$name" "no time left before ${STEP_DEADLINE_NAME:-the deadline}"
      return 1
    fi
    ((left < limit)) && limit=$left
  fi
  local start=$SECONDS status note
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  status=$?
  note="$(tail -n 1 "$OUT/$name.log" | cut -c1-70)"
  if [[ $status -eq 0 ]]; then
    summary_line "$name" PASS "$((SECONDS - start))s" "$note"
  else
    [[ $status -eq 124 ]] && note="timed out after ${limit}s; $note"
    summary_line "$name" FAIL "$((SECONDS - start))s" "rc=$status $note"
  fi
  return $status
}

print_summary() {  # prints SUMMARY; status 1 when a step failed
  printf '%s\n' "${SUMMARY[@]}"
  ! printf '%s\n' "${SUMMARY[@]}" | grep -q ' FAIL '
}
