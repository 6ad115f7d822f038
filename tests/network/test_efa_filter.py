"""EFA rules of ansible/plugins/filter/efa.py: the jobs' libfabric settings, the role's refusals (EFA promised on
a node without it, an unchecked installer) and reading which network NCCL chose from its INFO log."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("efa_filter", REPO / "ansible" / "plugins" / "filter" / "efa.py")
efa = importlib.util.module_from_spec(spec)
spec.loader.exec_module(efa)

CHECKSUM = "sha256:" + "ab" * 32
# /sys/bus/pci/devices/*/{vendor,device} of a p5 node (abridged): NVIDIA GPUs, an ENA, EFA devices.
P5_PCI = ["0x10de 0x2330", "0x1d0f 0xec20", "0x1d0f 0xefa1", "0x1d0f 0xefa1", "0x8086 0x1237"]
G6E_PCI = ["0x10de 0x26b9", "0x1d0f 0xec20"]
# What NCCL 2.2x prints with aws-ofi-nccl loaded (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET), and without it.
OFI_LOG = """node1:1234:1234 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v9)
node1:1234:1234 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.14.0
node1:1234:1234 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 32 nics)
node1:1234:1234 [0] NCCL INFO Using network Libfabric
node1:1234:1234 [0] NCCL INFO ncclCommInitRank comm 0x55 rank 0 nranks 2 - Init COMPLETE
"""
SOCKET_LOG = """node1:99:99 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
node1:99:99 [0] NCCL INFO NET/IB : No device found.
node1:99:99 [0] NCCL INFO NET/Socket : Using [0]ens5:10.42.128.10<0>
node1:99:99 [0] NCCL INFO Using network Socket
"""
# The plugin loaded but libfabric fell back to TCP (FI_PROVIDER unset, no EFA device): not EFA.
OFI_TCP_LOG = """n:1:1 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is 10.42.128.0/24 (found 1 nics)
n:1:1 [0] NCCL INFO Using network Libfabric
"""


def test_job_environment_follows_device_rdma():
    assert efa.efa_job_environment(True) == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
    assert efa.efa_job_environment(False) == {"FI_PROVIDER": "efa"}
    assert efa.efa_job_environment(True, {"FI_EFA_USE_DEVICE_RDMA": "", "OFI_NCCL_PROTOCOL": "RDMA"}) == {
        "FI_PROVIDER": "efa", "OFI_NCCL_PROTOCOL": "RDMA"}


def test_efa_devices_are_found_on_the_pci_bus():
    assert efa.efa_pci_devices(P5_PCI) == ["0xefa1", "0xefa1"]
    assert efa.efa_pci_devices(G6E_PCI) == []


def test_a_node_with_efa_and_a_checksum_has_no_problem():
    assert efa.efa_problems(32, P5_PCI, CHECKSUM) == []


@pytest.mark.parametrize(("args", "message"), [
    ((4, G6E_PCI, CHECKSUM), "efa_interfaces is 4 but the node has no EFA device on its PCI bus"),
    ((32, P5_PCI, ""), "efa_installer_checksum is '': give sha256:<64 hex digits>"),
    ((32, P5_PCI, "md5:" + "a" * 32), "efa_installer_checksum is 'md5:"),
    ((32, P5_PCI, CHECKSUM, {"NCCL_PROTO": "simple"}), "efa_job_env_extra has NCCL_PROTO"),
])
def test_wrong_settings_are_named(args, message):
    problems = efa.efa_problems(*args)
    assert any(message in problem for problem in problems), problems


def test_the_network_nccl_chose_is_read_from_its_log():
    assert efa.nccl_chosen_network(OFI_LOG) == "Libfabric"
    assert efa.nccl_chosen_network(SOCKET_LOG) == "Socket"
    assert efa.nccl_chosen_network("") == ""
    assert efa.nccl_chosen_network("n:1:1 [0] NCCL INFO Using network AWS Libfabric\n") == "AWS Libfabric"


def test_only_libfabric_over_efa_counts_as_the_ofi_plugin():
    assert efa.nccl_uses_ofi(OFI_LOG)
    older_plugin = "NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)\nNCCL INFO Using network AWS Libfabric\n"
    assert efa.nccl_uses_ofi(older_plugin)
    assert not efa.nccl_uses_ofi(SOCKET_LOG)
    assert not efa.nccl_uses_ofi(OFI_TCP_LOG)
