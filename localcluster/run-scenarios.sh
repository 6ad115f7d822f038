#!/usr/bin/env bash
# Runs molecule scenarios, JOBS at a time (most of their time is spent waiting on apt and systemd,
# so two share two cores well). Each scenario's log goes to .cache/molecule-logs/<scenario>.log; a
# failed scenario's log tail is printed. Exits non-zero when any scenario failed.
# Usage: run-scenarios.sh JOBS SCENARIO...
set -uo pipefail
jobs=$1; shift
logs=.cache/molecule-logs
mkdir -p "$logs"

run_one() {
  local scenario=$1 start=$EPOCHREALTIME
  if molecule test -s "$scenario" >"$logs/$scenario.log" 2>&1; then
    printf '[molecule] %-12s passed in %.0f s\n' "$scenario" "$(python3 -c "print($EPOCHREALTIME - $start)")"
  else
    printf '[molecule] %-12s FAILED after %.0f s; the end of %s:\n' "$scenario" \
      "$(python3 -c "print($EPOCHREALTIME - $start)")" "$logs/$scenario.log"
    sed 's/\x1b\[[0-9;]*m//g' "$logs/$scenario.log" | tail -n 60
    return 1
  fi
}
export -f run_one
export logs
printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'run_one {}'
