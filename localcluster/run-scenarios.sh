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
    echo "$scenario" >>"$logs/failed"
    return 1
  fi
}
# The failing task and its message, printed again once every scenario has ended: the log tails above
# are interleaved and long, and whoever reads only the end of the output should see why it failed.
failed_task() {
  sed 's/\x1b\[[0-9;]*m//g' "$1" | awk '
    /TASK \[/ { task = $0 }
    /fatal: \[|FAILED!/ { last_task = task; n = 0; message = "" }
    last_task != "" && n < 10 { message = message $0 "\n"; n++ }
    END { if (last_task != "") printf "%s\n%s", last_task, message; else print "  (no failed task in the log)" }'
}
export -f run_molecule run_one
export logs
rm -f "$logs/failed"
printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'run_one {}'
status=$?
if [[ -s $logs/failed ]]; then
  while read -r scenario; do
    printf '[molecule] %s failed; its last failed task (log: %s):\n' "$scenario" "$logs/$scenario.log"
    failed_task "$logs/$scenario.log" | cut -c1-400
  done <"$logs/failed"
fi
exit "$status"
