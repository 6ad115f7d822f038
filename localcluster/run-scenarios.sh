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
# is never retried. A scenario still running after MOLECULE_SCENARIO_TIMEOUT_S seconds is stopped and
# run once more: a hang is the environment's (gpu_stack's apt-get update, through the package cache,
# twice waited forever with its gpgv method in two rehearsals of .ci/run, and passed when run again
# alone), and without a limit it would hold the whole run; a second hang fails it. `molecule test`
# starts by destroying its nodes. The slowest, slurm, takes about 12 minutes; it ran past 15 once, when
# the other lane's scenario installed its virtualenv (torch) at the same time, so the limit is 20.
timeout_s=${MOLECULE_SCENARIO_TIMEOUT_S:-1200}
# timeout's exit status for a command it stopped (TERM, then KILL after --kill-after)
stopped() { [[ $1 -eq 124 || $1 -eq 137 ]]; }
# One try of a scenario; one that ran past the limit has its nodes removed (a stopped molecule leaves them).
try_molecule() {
  local scenario=$1 rc
  timeout --kill-after=60 "$timeout_s" molecule test -s "$scenario" >"$logs/$scenario.log" 2>&1
  rc=$?
  if stopped "$rc"; then
    timeout 300 molecule destroy -s "$scenario" >>"$logs/$scenario.log" 2>&1
    echo "(stopped after $timeout_s s, MOLECULE_SCENARIO_TIMEOUT_S; its nodes removed)" >>"$logs/$scenario.log"
  fi
  return "$rc"
}
run_molecule() {
  local scenario=$1 rc why
  try_molecule "$scenario"
  rc=$?
  [[ $rc -eq 0 ]] && return 0
  if stopped "$rc"; then
    why="ran past MOLECULE_SCENARIO_TIMEOUT_S=$timeout_s s and was stopped"
  elif [[ $(python3 localcluster/molecule_failure.py step "$logs/$scenario.log") =~ ^(create|prepare)$ ]]; then
    why="failed in create/prepare"
  else
    return 1
  fi
  mv "$logs/$scenario.log" "$logs/$scenario.first-try.log"
  printf '[molecule] %-12s %s; running it once more (first log: %s)\n' "$scenario" "$why" \
    "$logs/$scenario.first-try.log"
  try_molecule "$scenario"
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
export -f stopped try_molecule run_molecule run_one
export logs timeout_s
rm -f "$logs/failed"
printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'run_one {}'
status=$?
# Why each failed scenario failed (the step, molecule's complaint, the last failed task and its message),
# printed again once every scenario has ended: the log tails above are interleaved and long, and whoever
# reads only the end of the output should see why it failed.
if [[ -s $logs/failed ]]; then
  while read -r scenario; do
    printf '[molecule] %s failed; why (log: %s):\n' "$scenario" "$logs/$scenario.log"
    python3 localcluster/molecule_failure.py summary "$logs/$scenario.log" | cut -c1-400
  done <"$logs/failed"
fi
exit "$status"
