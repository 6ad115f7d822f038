"""Input rules of the GPU stack: the nvidia_driver settings, the driver check of a running node (nvidia-smi's
answer against what the settings expect) and the cuda_toolkit settings. Each filter returns one message per
problem, each naming the setting and the fix; an empty list means fine. Used by the nvidia_driver and
cuda_toolkit roles; unit-tested in tests/gpu_stack."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

# Filters cannot import module_utils or each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
values = _load("ansible/plugins/module_utils/values.py")
# Each value read as the playbooks read it (module_utils/values.py).
_text, _truthy, _int = values.text, values.ansible_bool, values.jinja_int

_BRANCH = re.compile(r"^[0-9]{3}$")
_TOOLKIT_VERSION = re.compile(r"^[0-9]+\.[0-9]+$")
_MODE = re.compile(r"^0?[0-7]{3}$")


def _of_branch(version, branch):
    return re.match(re.escape(_text(branch)) + r"\.", _text(version)) is not None


def nvidia_driver_settings_problems(settings):
    """Driver settings that cannot work on this node. `settings`: system (e.g. 'Debian 12'), distribution
    (ansible_distribution), branch (the resolved branch), version, source, distribution_branch, fabricmanager,
    distribution_fabricmanager_package, cuda_repo_key_fingerprint, device_mode."""
    problems = []
    system = _text(settings.get("system"))
    branch = _text(settings.get("branch"))
    version = _text(settings.get("version"))
    source = _text(settings.get("source"))
    distribution_branch = _text(settings.get("distribution_branch"))
    fingerprint = _text(settings.get("cuda_repo_key_fingerprint"))
    if not _BRANCH.match(branch):
        problems.append(f"nvidia_driver_branch is '{branch}': give the driver's major version, three digits, e.g. 570")
    if version and not _of_branch(version, branch):
        problems.append(f"nvidia_driver_version {version} is not of branch {branch} (nvidia_driver_branch): "
                        "make them agree or leave nvidia_driver_version empty")
    if source == "distribution" and _text(settings.get("distribution")) == "Debian" and branch != distribution_branch:
        problems.append(f"{system} ships only driver branch {distribution_branch}, not {branch} "
                        "(nvidia_driver_branch): set nvidia_driver_source: cuda_repo for other branches, "
                        "or leave nvidia_driver_branch empty")
    if (_truthy(settings.get("fabricmanager")) and source == "distribution"
            and not _text(settings.get("distribution_fabricmanager_package"))):
        problems.append(f"{system} has no Fabric Manager package (nvidia_driver_fabricmanager): "
                        "set nvidia_driver_source: cuda_repo on NVSwitch systems")
    if source == "cuda_repo" and len(re.sub(r"\s", "", fingerprint)) != 40:
        problems.append(f"nvidia_driver_cuda_repo_key_fingerprint '{fingerprint}' is not a 40-digit OpenPGP "
                        "fingerprint: copy it from NVIDIA's documentation")
    device_mode = settings.get("device_mode")
    if not isinstance(device_mode, str):
        # YAML reads an unquoted 0660 as the number 432, which would pass as mode 0432.
        problems.append(f"nvidia_driver_gpu_device_mode is the number {device_mode}, not a string: quote it, "
                        "e.g. \"0660\" (YAML reads an unquoted 0660 as 432)")
    elif not _MODE.match(device_mode):
        problems.append(f"nvidia_driver_gpu_device_mode is '{device_mode}': write it as a quoted octal string such "
                        "as \"0660\"")
    return problems


def nvidia_driver_check_problems(smi, gpus, settings):
    """Ways the GPUs differ from what the settings expect. `smi`: the registered nvidia-smi command (rc, stdout,
    stderr, msg); `gpus`: its parsed rows (index, bus_id, name, driver_version, persistence_mode, ecc_mode);
    `settings`: expected_gpus, pci_gpu_count (GPUs on the PCI bus), branch (nvidia_driver_branch),
    resolved_branch (the branch the role resolved, if it ran), require_persistence_mode, require_ecc."""
    problems = []
    smi = smi or {}
    gpus = list(gpus or ())
    expected_setting = _int(settings.get("expected_gpus"))
    expected = expected_setting if expected_setting > 0 else _int(settings.get("pci_gpu_count"))
    rc = smi.get("rc")
    if rc in (2, 127):
        problems.append("nvidia-smi is not installed or not on the PATH: install the driver (the nvidia_driver role "
                        "does), or put the driver's bin folder on the PATH")
        return problems
    if rc != 0:
        output = f"{_text(smi.get('stderr', ''))} {_text(smi.get('stdout', ''))}".strip() or _text(smi.get("msg", ""))
        problems.append(f"nvidia-smi failed (rc {rc}): {output}: check that the driver is installed and loaded "
                        "(lsmod | grep nvidia, dmesg)")
        return problems
    if len(gpus) != expected:
        which = " (nvidia_driver_expected_gpus)" if expected_setting > 0 else " (as many as on the PCI bus)"
        problems.append(f"nvidia-smi lists {len(gpus)} GPU(s), expected {expected}{which}: look for fallen-off GPUs in "
                        "dmesg (Xid 79) and reseat or replace them, or correct nvidia_driver_expected_gpus")
    branch = _text(settings.get("branch")) or _text(settings.get("resolved_branch"))
    for gpu in gpus:
        where = f"GPU {gpu.get('index')} ({gpu.get('bus_id')}, {gpu.get('name')})"
        if branch and not _of_branch(gpu.get("driver_version"), branch):
            problems.append(f"{where}: driver {gpu.get('driver_version')} is not of branch {branch} "
                            "(nvidia_driver_branch): reboot into the installed driver, or set the branch to the "
                            "one you run")
        if _truthy(settings.get("require_persistence_mode")) and gpu.get("persistence_mode") != "Enabled":
            problems.append(f"{where}: persistence mode is {gpu.get('persistence_mode')} "
                            "(nvidia_driver_require_persistence_mode): start nvidia-persistenced "
                            "(nvidia_driver_persistenced: true) or run nvidia-smi -pm 1")
        if _truthy(settings.get("require_ecc")) and gpu.get("ecc_mode") != "Enabled":
            problems.append(f"{where}: ECC is {gpu.get('ecc_mode')} (nvidia_driver_require_ecc): enable it "
                            "(nvidia-smi -e 1, then reboot), or set nvidia_driver_require_ecc: false for GPUs "
                            "without ECC")
    return problems


def cuda_toolkit_settings_problems(settings):
    """Toolkit settings that cannot work on this node. `settings`: system (e.g. 'Debian 12'), version, source,
    distribution_release (the CUDA release the distribution ships), nccl."""
    problems = []
    version = _text(settings.get("version"))
    source = _text(settings.get("source"))
    release = _text(settings.get("distribution_release"))
    if version and not _TOOLKIT_VERSION.match(version):
        problems.append(f"cuda_toolkit_version is '{version}': give major.minor, e.g. 12.8")
    if source == "cuda_repo" and not version:
        problems.append("cuda_toolkit_source is cuda_repo but cuda_toolkit_version is empty: pin a release, e.g. "
                        "cuda_toolkit_version: '12.8'")
    if source == "distribution" and version and version != release:
        problems.append(f"{_text(settings.get('system'))} ships CUDA {release}, not {version} (cuda_toolkit_version): "
                        "set cuda_toolkit_source: cuda_repo, or leave the version empty")
    if _truthy(settings.get("nccl")) and source != "cuda_repo":
        problems.append("cuda_toolkit_nccl needs NVIDIA's CUDA repository: set cuda_toolkit_source: cuda_repo "
                        "(and cuda_toolkit_version)")
    return problems


class FilterModule:
    def filters(self):
        return {"nvidia_driver_settings_problems": nvidia_driver_settings_problems,
                "nvidia_driver_check_problems": nvidia_driver_check_problems,
                "cuda_toolkit_settings_problems": cuda_toolkit_settings_problems}
