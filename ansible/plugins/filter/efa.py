"""EFA on AWS GPU nodes: the libfabric settings of training jobs, the role's input problems, and which network
NCCL chose (read from its NCCL_DEBUG=INFO log). Used by the efa role and verify.yml; unit-tested in tests/network."""

from __future__ import annotations

import re

AMAZON_PCI_VENDOR = "0x1d0f"
# EFA's PCI device ids start with 0xefa (efa0 on p4d, efa1 on p5, efa2/efa3 on later types).
EFA_PCI_DEVICE = re.compile(r"^0xefa[0-9a-f]$")
_CHECKSUM = re.compile(r"^sha256:[0-9a-fA-F]{64}$")
# NCCL prints "NET/<name> ..." for the network it uses and "Using network <name>" (2.12+); the OFI plugin
# names itself Libfabric ("AWS Libfabric" in older plugin versions) and logs its own lines as NET/OFI.
# aws-ofi-nccl reports its libfabric provider: "NET/OFI Selected Provider is efa" (older), "NET/OFI Selected
# provider is efa, fabric is efa (found 32 nics)" (newer).
_USING_NETWORK = re.compile(r"Using network (.+?)\s*$", re.MULTILINE)
_OFI_EFA = re.compile(r"NET/OFI.*provider is efa\b", re.IGNORECASE)


def efa_job_environment(device_rdma, extra=None):
    """The variables a training job needs for NCCL over EFA (an empty value in `extra` removes one)."""
    env = {
        # libfabric's efa provider only: never fall back to its TCP provider, which would look like EFA and run
        # at socket speed.
        "FI_PROVIDER": "efa",
    }
    if device_rdma:
        env["FI_EFA_USE_DEVICE_RDMA"] = "1"
    for key, value in (extra or {}).items():
        if value is None or str(value) == "":
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def efa_pci_devices(pci_lines):
    """EFA devices among 'VENDOR DEVICE' lines of /sys/bus/pci/devices/*/{vendor,device}."""
    found = []
    for line in pci_lines or ():
        parts = str(line).split()
        if len(parts) == 2 and parts[0].lower() == AMAZON_PCI_VENDOR and EFA_PCI_DEVICE.match(parts[1].lower()):
            found.append(parts[1].lower())
    return found


def efa_problems(interfaces, pci_lines, checksum, extra=None):
    """The problems of the efa role's settings on a node (empty: fine)."""
    problems = []
    devices = efa_pci_devices(pci_lines)
    if int(interfaces) > 0 and not devices:
        problems.append(f"efa_interfaces is {interfaces} but the node has no EFA device on its PCI bus: the instance "
                        "type has no EFA, or the stack was made with efa false; set efa_interfaces to 0 for this "
                        "host, or use an instance type with EFA (pulumi/aws instance_types.py lists them)")
    if not _CHECKSUM.match(str(checksum or "")):
        problems.append(f"efa_installer_checksum is '{checksum}': give sha256:<64 hex digits> of the installer "
                        "tarball (sha256sum of a copy whose GPG signature you checked), so the download is verified")
    for key in (extra or {}):
        if not (str(key).startswith("FI_") or str(key).startswith("OFI_NCCL_")):
            problems.append(f"efa_job_env_extra has {key}: only FI_* (libfabric) and OFI_NCCL_* (aws-ofi-nccl) "
                            "settings belong there; NCCL_* ones go to network_tuning_nccl_extra")
    return problems


def nccl_chosen_network(log):
    """The network NCCL said it uses ('Libfabric', 'Socket', 'IB', ...), or '' when the log names none."""
    text = str(log or "")
    names = [match.group(1).strip() for match in _USING_NETWORK.finditer(text)]
    return names[0] if names else ""


def nccl_uses_ofi(log):
    """NCCL chose aws-ofi-nccl (libfabric) for its network, and libfabric's provider is efa."""
    network = nccl_chosen_network(log)
    return "libfabric" in network.lower() and bool(_OFI_EFA.search(str(log or "")))


class FilterModule:
    def filters(self):
        return {"efa_job_environment": efa_job_environment, "efa_problems": efa_problems,
                "efa_pci_devices": efa_pci_devices, "nccl_chosen_network": nccl_chosen_network,
                "nccl_uses_ofi": nccl_uses_ofi}
