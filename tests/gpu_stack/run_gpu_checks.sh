#!/usr/bin/env bash
# The GPU lane of the gpu_stack roles, on a GPU machine without apt, systemd or Ansible: installs
# ansible-core from wheels carried in WHEELS, then runs the driver role's checks with a local
# connection, once as a cluster would (must pass) and once with wrong expectations (must fail
# with messages naming the variables). Logs go to OUT_DIR.
#
# Usage: run_gpu_checks.sh WHEELS OUT_DIR BRANCH GPUS
set -uo pipefail
wheels=$1 out=$2 branch=$3 gpus=$4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site LC_ALL=C.UTF-8 ANSIBLE_CONFIG=$PWD/tests/gpu_stack/ansible.cfg ANSIBLE_FORCE_COLOR=0
playbook() { python3 /tmp/site/bin/ansible-playbook -i localhost, -c local -e ansible_python_interpreter="$(command -v python3)" \
  tests/gpu_stack/gpu_check.yml "$@"; }
mkdir -p "$out"
{ nvidia-smi --query-gpu=index,name,driver_version,persistence_mode,ecc.mode.current --format=csv; \
  python3 roles/nvidia_driver/files/gpu_probe.py; echo; } 2>&1 | tee "$out/smi.txt"
playbook -e nvidia_driver_branch="$branch" -e nvidia_driver_expected_gpus="$gpus" 2>&1 | tee "$out/check_expected.log"
echo "rc of the check with the right expectations: ${PIPESTATUS[0]}" | tee -a "$out/check_expected.log"
playbook -e nvidia_driver_branch=535 -e nvidia_driver_expected_gpus=8 2>&1 | tee "$out/check_wrong.log"
echo "rc of the check with wrong expectations (must be 2): ${PIPESTATUS[0]}" | tee -a "$out/check_wrong.log"
