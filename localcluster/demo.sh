#!/usr/bin/env bash
# `make demo`: the whole cluster on this machine, a line per phase with its time, then the verdict.
#   cluster-up (NODES podman nodes) -> site.yml -> verify.yml -> the report
# Logs of each phase: .cache/demo/<phase>.log (shown when a phase fails).
set -uo pipefail
cd "$(dirname "$0")/.."
nodes=${NODES:-3}
logs=.cache/demo
mkdir -p "$logs"
total_start=$EPOCHREALTIME

phase() {
  local name=$1; shift
  local start=$EPOCHREALTIME
  printf '[demo] %-28s ...\n' "$name"
  if "$@" >"$logs/$name.log" 2>&1; then
    printf '[demo] %-28s done in %5.0f s\n' "$name" "$(python3 -c "print($EPOCHREALTIME - $start)")"
  else
    printf '[demo] %-28s FAILED after %.0f s; the end of %s:\n' "$name" "$(python3 -c "print($EPOCHREALTIME - $start)")" "$logs/$name.log"
    sed 's/\x1b\[[0-9;]*m//g' "$logs/$name.log" | tail -n 40
    exit 1
  fi
}

phase cluster-up .venv/bin/python localcluster/cluster.py up --nodes "$nodes"
phase site.yml .venv/bin/ansible-playbook site.yml -i inventories/local
phase verify.yml .venv/bin/ansible-playbook ansible/playbooks/verify.yml -i inventories/local
report=$(ls -t reports/verify-*.json 2>/dev/null | head -n 1)
# The table verify.yml printed, without Ansible's framing.
sed -n '/Show the verdict of every check/,/^$/p' "$logs/verify.yml.log" | grep -E '^\s+"' | sed 's/^ *"//; s/",\?$//'
printf '[demo] the cluster is ready in %.0f s; report: %s\n' "$(python3 -c "print($EPOCHREALTIME - $total_start)")" "$report"
