#!/usr/bin/env bash
# Runs molecule scenarios, JOBS at a time (most of their time is spent waiting on apt and systemd,
# so two share two cores well). Each scenario's log goes to .cache/molecule-logs/<scenario>.log; a
# failed scenario's log tail is printed. Exits non-zero when any scenario failed.
# Usage: run-scenarios.sh JOBS SCENARIO...
set -uo pipefail
jobs=$1; shift
logs=.cache/molecule-logs
mkdir -p "$logs"

# A scenario that fails while its nodes are made (create) or given their starting state (prepare) is
# run once more: those steps only start containers and fetch packages, and a package cache answering
# many nodes at once can hand out a broken package list. A failure in converge, idempotence or verify
# is never retried.
run_molecule() {
  local scenario=$1
  molecule test -s "$scenario" >"$logs/$scenario.log" 2>&1 && return 0
  if grep -Eq "➜ (create|prepare): Executed: Failed" "$logs/$scenario.log"; then
    mv "$logs/$scenario.log" "$logs/$scenario.first-try.log"
    printf '[molecule] %-12s failed in create/prepare; running it once more (first log: %s)\n' \
      "$scenario" "$logs/$scenario.first-try.log"
    molecule test -s "$scenario" >"$logs/$scenario.log" 2>&1 && return 0
  fi
  return 1
}

run_one() {
  local scenario=$1 start=$EPOCHREALTIME
  if run_molecule "$scenario"; then
    printf '[molecule] %-12s passed in %.0f s\n' "$scenario" "$(python3 -c "print($EPOCHREALTIME - $start)")"
  else
    printf '[molecule] %-12s FAILED after %.0f s; the end of %s:\n' "$scenario" \
      "$(python3 -c "print($EPOCHREALTIME - $start)")" "$logs/$scenario.log"
    sed 's/\x1b\[[0-9;]*m//g' "$logs/$scenario.log" | tail -n 60
    return 1
  fi
}
export -f run_molecule run_one
export logs
printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'run_one {}'
