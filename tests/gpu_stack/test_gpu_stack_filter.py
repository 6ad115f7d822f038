"""Input rules of ansible/plugins/filter/gpu_stack.py: the nvidia_driver settings, the driver check of a node
(nvidia-smi's answer against the expectations) and the cuda_toolkit settings; good inputs give no problem, each
bad one gives the message that names the setting and the fix."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_stack_filter",
                                              REPO / "ansible" / "plugins" / "filter" / "gpu_stack.py")
gpu_stack = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_stack)

FINGERPRINT = "EB69 3B30 35CD 5710 E231  E123 A4B4 6996 3BF8 63CC"
DRIVER = {"system": "Ubuntu 24", "distribution": "Ubuntu", "branch": "570", "version": "", "source": "distribution",
          "distribution_branch": "570", "fabricmanager": False,
          "distribution_fabricmanager_package": "nvidia-fabricmanager-570", "cuda_repo_key_fingerprint": FINGERPRINT,
          "device_mode": "0660"}


def driver(**changes):
    return gpu_stack.nvidia_driver_settings_problems({**DRIVER, **changes})


def test_driver_settings_good():
    assert driver() == []
    assert driver(version="570.133.20", source="cuda_repo", fabricmanager=True) == []
    assert driver(system="Debian 12", distribution="Debian", branch="535", distribution_branch="535") == []


def test_driver_branch_not_three_digits():
    assert driver(branch="57") == ["nvidia_driver_branch is '57': give the driver's major version, three digits, "
                                   "e.g. 570"]


def test_driver_version_of_another_branch():
    assert driver(version="550.54.15") == [
        "nvidia_driver_version 550.54.15 is not of branch 570 (nvidia_driver_branch): make them agree or leave "
        "nvidia_driver_version empty"]
    # A prefix of the branch without the dot is not the branch: 5701.x is not of 570.
    assert len(driver(version="5701.1")) == 1


def test_driver_debian_ships_one_branch():
    assert driver(system="Debian 12", distribution="Debian", distribution_branch="535") == [
        "Debian 12 ships only driver branch 535, not 570 (nvidia_driver_branch): set nvidia_driver_source: cuda_repo "
        "for other branches, or leave nvidia_driver_branch empty"]
    # Ubuntu packages every branch: no problem there.
    assert driver(distribution_branch="535") == []


def test_driver_fabricmanager_missing():
    assert driver(fabricmanager="yes", system="Debian 12", distribution="Debian", branch="535",
                  distribution_branch="535", distribution_fabricmanager_package="") == [
        "Debian 12 has no Fabric Manager package (nvidia_driver_fabricmanager): set nvidia_driver_source: cuda_repo "
        "on NVSwitch systems"]


def test_driver_fingerprint():
    assert driver(source="cuda_repo", cuda_repo_key_fingerprint="ABCD") == [
        "nvidia_driver_cuda_repo_key_fingerprint 'ABCD' is not a 40-digit OpenPGP fingerprint: copy it from NVIDIA's "
        "documentation"]
    # Only read for the CUDA repository.
    assert driver(cuda_repo_key_fingerprint="ABCD") == []


def test_driver_device_mode():
    assert driver(device_mode="660") == [] and driver(device_mode="0640") == []
    assert driver(device_mode="0668") == ["nvidia_driver_gpu_device_mode is '0668': write it as a quoted octal string "
                                          "such as \"0660\""]
    assert driver(device_mode="rw-rw----") == ["nvidia_driver_gpu_device_mode is 'rw-rw----': write it as a quoted "
                                               "octal string such as \"0660\""]
    # An unquoted 0660 in YAML 1.1 arrives as 432.
    assert driver(device_mode=432) == ["nvidia_driver_gpu_device_mode is the number 432, not a string: quote it, "
                                       "e.g. \"0660\" (YAML reads an unquoted 0660 as 432)"]


def gpu(index, version="570.133.20", persistence="Enabled", ecc="Enabled"):
    return {"index": index, "bus_id": f"00000000:0{index}:00.0", "driver_version": version,
            "persistence_mode": persistence, "ecc_mode": ecc, "memory_mib": 81559, "name": "NVIDIA H100 80GB HBM3"}


CHECK = {"expected_gpus": 0, "pci_gpu_count": 2, "branch": "", "resolved_branch": "570",
         "require_persistence_mode": True, "require_ecc": True}
OK = {"rc": 0, "stdout": "", "stderr": ""}


def check(smi=OK, gpus=None, **changes):
    return gpu_stack.nvidia_driver_check_problems(smi, [gpu(0), gpu(1)] if gpus is None else gpus, {**CHECK, **changes})


def test_check_good():
    assert check() == []
    assert check(expected_gpus="2", branch="570", resolved_branch="") == []
    assert check(gpus=[gpu(0, persistence="Disabled", ecc="Disabled"), gpu(1)], require_persistence_mode="false",
                 require_ecc=False) == []


def test_check_smi_missing_or_failing():
    missing = ["nvidia-smi is not installed or not on the PATH: install the driver (the nvidia_driver role does), or "
               "put the driver's bin folder on the PATH"]
    assert check({"rc": 127, "stdout": "", "stderr": ""}) == missing
    assert check({"rc": 2, "msg": "[Errno 2] No such file or directory"}) == missing
    assert check({"rc": 9, "stdout": "", "stderr": "NVIDIA-SMI has failed because it couldn't communicate with the "
                  "NVIDIA driver."}) == [
        "nvidia-smi failed (rc 9): NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.: "
        "check that the driver is installed and loaded (lsmod | grep nvidia, dmesg)"]
    # No output at all: the module's message stands in.
    assert check({"rc": 1, "stdout": "", "stderr": "", "msg": "non-zero return code"})[0].startswith(
        "nvidia-smi failed (rc 1): non-zero return code: ")


def test_check_gpu_count():
    assert check(gpus=[gpu(0)]) == [
        "nvidia-smi lists 1 GPU(s), expected 2 (as many as on the PCI bus): look for fallen-off GPUs in dmesg "
        "(Xid 79) and reseat or replace them, or correct nvidia_driver_expected_gpus"]
    assert check(expected_gpus=8)[0].startswith("nvidia-smi lists 2 GPU(s), expected 8 (nvidia_driver_expected_gpus): ")


def test_check_per_gpu():
    where = "GPU 1 (00000000:01:00.0, NVIDIA H100 80GB HBM3)"
    assert check(gpus=[gpu(0), gpu(1, version="535.230.02", persistence="Disabled", ecc="Disabled")]) == [
        f"{where}: driver 535.230.02 is not of branch 570 (nvidia_driver_branch): reboot into the installed driver, "
        "or set the branch to the one you run",
        f"{where}: persistence mode is Disabled (nvidia_driver_require_persistence_mode): start nvidia-persistenced "
        "(nvidia_driver_persistenced: true) or run nvidia-smi -pm 1",
        f"{where}: ECC is Disabled (nvidia_driver_require_ecc): enable it (nvidia-smi -e 1, then reboot), or set "
        "nvidia_driver_require_ecc: false for GPUs without ECC"]
    # The set branch wins over the one the role resolved; no branch at all checks none.
    assert len(check(branch="535")) == 2
    assert check(resolved_branch="", gpus=[gpu(0, version="535.1"), gpu(1)]) == []


TOOLKIT = {"system": "Ubuntu 24", "version": "", "source": "distribution", "distribution_release": "12.0",
           "nccl": False}


def toolkit(**changes):
    return gpu_stack.cuda_toolkit_settings_problems({**TOOLKIT, **changes})


def test_toolkit_good():
    assert toolkit() == []
    assert toolkit(version="12.0") == []
    assert toolkit(source="cuda_repo", version="12.8", nccl="true") == []


def test_toolkit_bad():
    assert toolkit(version="12") == [
        "cuda_toolkit_version is '12': give major.minor, e.g. 12.8",
        "Ubuntu 24 ships CUDA 12.0, not 12 (cuda_toolkit_version): set cuda_toolkit_source: cuda_repo, or leave the "
        "version empty"]
    assert toolkit(source="cuda_repo") == ["cuda_toolkit_source is cuda_repo but cuda_toolkit_version is empty: pin a "
                                           "release, e.g. cuda_toolkit_version: '12.8'"]
    assert toolkit(version="12.8") == ["Ubuntu 24 ships CUDA 12.0, not 12.8 (cuda_toolkit_version): set "
                                       "cuda_toolkit_source: cuda_repo, or leave the version empty"]
    assert toolkit(nccl=True) == ["cuda_toolkit_nccl needs NVIDIA's CUDA repository: set cuda_toolkit_source: "
                                  "cuda_repo (and cuda_toolkit_version)"]
