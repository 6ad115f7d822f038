"""Stack configuration, read once into a frozen object and validated before any resource is declared."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sd3_stack_settings import ConfigError, Namespace, refuse_unknown_keys

from .instance_types import GPU_INSTANCE_TYPES, GpuInstanceType

__all__ = ["AwsClusterConfig", "ConfigError", "load_config", "parse_config"]

PURCHASE_OPTIONS = ("on-demand", "spot", "capacity-reservation", "capacity-block")
SHARED_FILESYSTEMS = ("fsx-lustre", "efs", "none")
FSX_THROUGHPUTS_MB_PER_TIB = (125, 250, 500, 1000)
MAX_GPU_NODES = 64
_CLUSTER_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$")
_SSH_KEY = re.compile(
    r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh.com) [A-Za-z0-9+/=]+")
_RESERVATION_ID = re.compile(r"^cr-[0-9a-f]{8,17}$")
_AMI_ID = re.compile(r"^ami-[0-9a-f]{8,17}$")
# us-east-1a, and Local Zones' us-west-2-lax-1a.
_ZONE = re.compile(r"^[a-z]{2}(-[a-z0-9]+)+-?[0-9][a-z]$")
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")
_LINUX_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_PRICE = re.compile(r"^[0-9]+(\.[0-9]+)?$")
MAX_SPOT_PRICE_USD = 1000

NAMESPACE = Namespace("sd3-cluster-aws")
_ADMIN_CIDRS_FORM = ("set it as a list: `pulumi config set --path 'adminCidrs[0]' 203.0.113.7/32` (and "
                     "'adminCidrs[1]' for a second network), or a YAML list under the key in Pulumi.<stack>.yaml")
# Settings that are lists or maps, with the right form of each (what a plain-text value is told to do instead).
STRUCTURED_KEYS = {
    "adminCidrs": "list of networks; " + _ADMIN_CIDRS_FORM,
    "tags": "map of tag names to values: `pulumi config set --path tags.team vision`, or a YAML map under the key "
            "in Pulumi.<stack>.yaml",
}


@dataclass(frozen=True)
class AwsClusterConfig:
    cluster_name: str
    availability_zone: str
    admin_cidrs: tuple[str, ...]
    ssh_public_key: str
    gpu_instance_type: GpuInstanceType
    gpu_node_count: int
    vpc_cidr: str = "10.42.0.0/16"
    purchase_option: str = "on-demand"
    capacity_reservation_id: str | None = None
    spot_max_price: str | None = None
    efa: bool = True
    gpu_root_volume_gb: int = 500
    head_instance_type: str = "m7i.2xlarge"
    head_root_volume_gb: int = 200
    ami_id: str | None = None
    ssh_user: str = "ubuntu"
    shared_filesystem: str = "fsx-lustre"
    fsx_storage_capacity_gb: int = 1200
    fsx_throughput_mb_per_tib: int = 250
    tags: Mapping[str, str] = field(default_factory=dict)

    @property
    def efa_device_rdma(self) -> bool:
        """libfabric may use the EFA devices' RDMA to and from GPU memory (FI_EFA_USE_DEVICE_RDMA)."""
        return self.efa_interfaces > 0 and self.gpu_instance_type.efa_device_rdma

    @property
    def efa_interfaces(self) -> int:
        """EFA interfaces each GPU node gets: all its cards, or none when EFA is switched off."""
        return self.gpu_instance_type.efa_interfaces if self.efa else 0


def _key(name: str) -> str:
    return NAMESPACE.key(name)


_int = NAMESPACE.integer
_bool = NAMESPACE.boolean
_string = NAMESPACE.string


def _admin_cidrs(values: Mapping[str, Any]) -> tuple[str, ...]:
    cidrs = NAMESPACE.string_list(values, "adminCidrs", _ADMIN_CIDRS_FORM)
    if not cidrs:
        raise ConfigError(
            f"{_key('adminCidrs')} is missing: SSH to the head is allowed only from these networks; "
            "set your own address, e.g. `pulumi config set --path 'adminCidrs[0]' 203.0.113.7/32`")
    checked = []
    for cidr in cidrs:
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError:
            raise ConfigError(
                f"{_key('adminCidrs')} has '{cidr}', not a network in CIDR form (e.g. 203.0.113.7/32)") from None
        if network.prefixlen == 0:
            raise ConfigError(
                f"{_key('adminCidrs')} has '{cidr}', which opens SSH to the whole internet: "
                "use the networks you administer from (e.g. your office's /24 or your address as a /32)")
        checked.append(str(network))
    return tuple(checked)


def _network(values: Mapping[str, Any]) -> str:
    raw = str(values.get("vpcCidr", "10.42.0.0/16"))
    try:
        network = ipaddress.ip_network(raw, strict=True)
    except ValueError:
        raise ConfigError(f"{_key('vpcCidr')} is '{raw}', not a network in CIDR form (e.g. 10.42.0.0/16)") from None
    if network.version != 4 or not network.is_private or not 16 <= network.prefixlen <= 22:
        raise ConfigError(
            f"{_key('vpcCidr')} is '{raw}': use a private IPv4 network from /16 to /22 (e.g. 10.42.0.0/16); "
            "it is split into a public subnet for the head and a private one for the GPU nodes")
    return str(network)


def parse_config(values: Mapping[str, Any]) -> AwsClusterConfig:
    """Validate the stack's settings (keys as in Pulumi.<stack>.yaml, without the project prefix)."""
    refuse_unknown_keys(values, CONFIG_KEYS, f"the stack configuration ({NAMESPACE.project}:*)")
    cluster_name = str(_string(values, "clusterName", "sd3"))
    if not _CLUSTER_NAME.match(cluster_name):
        raise ConfigError(
            f"{_key('clusterName')} is '{cluster_name}': use 2 to 32 lower-case letters, digits and dashes, "
            "starting with a letter (it prefixes host names and AWS resource names)")

    zone = _string(values, "availabilityZone", None)
    if not zone:
        raise ConfigError(
            f"{_key('availabilityZone')} is missing: GPU capacity and the cluster placement group live in one zone; "
            "set the zone of your capacity, e.g. `pulumi config set availabilityZone us-east-1a`")
    if not _ZONE.match(zone):
        raise ConfigError(f"{_key('availabilityZone')} is '{zone}': give a zone name such as us-east-1a (a region "
                          "name and a letter; the region itself is aws:region)")

    type_name = str(_string(values, "gpuInstanceType", "p5.48xlarge"))
    if type_name not in GPU_INSTANCE_TYPES:
        raise ConfigError(
            f"{_key('gpuInstanceType')} is '{type_name}', which this stack does not know; "
            f"choose one of {', '.join(sorted(GPU_INSTANCE_TYPES))} (or add it to sd3_aws/instance_types.py)")

    count = _int(values, "gpuNodeCount", 2)
    if not 1 <= count <= MAX_GPU_NODES:
        raise ConfigError(f"{_key('gpuNodeCount')} is {count}: a cluster has 1 to {MAX_GPU_NODES} GPU nodes")

    purchase = str(_string(values, "purchaseOption", "on-demand"))
    if purchase not in PURCHASE_OPTIONS:
        raise ConfigError(f"{_key('purchaseOption')} is '{purchase}': choose one of {', '.join(PURCHASE_OPTIONS)}")
    reservation = _string(values, "capacityReservationId", None) or None
    if purchase in ("capacity-reservation", "capacity-block"):
        if not reservation:
            raise ConfigError(
                f"{_key('purchaseOption')} is '{purchase}' but {_key('capacityReservationId')} is missing: "
                "set the reservation's id (cr-...) from the EC2 console or `aws ec2 describe-capacity-reservations`")
        if not _RESERVATION_ID.match(str(reservation)):
            raise ConfigError(
                f"{_key('capacityReservationId')} is '{reservation}': a reservation id looks like cr-0123456789abcdef0")
    elif reservation:
        raise ConfigError(
            f"{_key('capacityReservationId')} is set but {_key('purchaseOption')} is '{purchase}': "
            "set purchaseOption to capacity-reservation or capacity-block, or remove the id")
    spot_max_price = _string(values, "spotMaxPrice", None) or None
    if spot_max_price is not None and purchase != "spot":
        raise ConfigError(
            f"{_key('spotMaxPrice')} is set but {_key('purchaseOption')} is '{purchase}': it applies to spot only")
    if spot_max_price is not None and (not _PRICE.match(spot_max_price)
                                       or not 0 < float(spot_max_price) <= MAX_SPOT_PRICE_USD):
        raise ConfigError(f"{_key('spotMaxPrice')} is '{spot_max_price}': give USD per hour as a number above 0 and "
                          f"at most {MAX_SPOT_PRICE_USD}, e.g. 40.5 (leave it unset for up to the On-Demand price)")

    ssh_public_key = str(_string(values, "sshPublicKey", "")).strip()
    key_hint = "`pulumi config set sshPublicKey \"$(cat ~/.ssh/id_ed25519.pub)\"`"
    if not ssh_public_key:
        raise ConfigError(f"{_key('sshPublicKey')} is missing: the key pair of every node is made from it; {key_hint}")
    if not _SSH_KEY.match(ssh_public_key):
        shown = ssh_public_key if len(ssh_public_key) <= 40 else ssh_public_key[:40] + "..."
        raise ConfigError(
            f"{_key('sshPublicKey')} is '{shown}', not an OpenSSH public key (a line such as ssh-ed25519 AAAA... "
            f"from a .pub file, never the private key): {key_hint}")

    instance_type = GPU_INSTANCE_TYPES[type_name]
    # Unset: EFA wherever the type has it. Asked for on a type without it: said, not silently dropped.
    efa = _bool(values, "efa", instance_type.efa_interfaces > 0)
    if efa and instance_type.efa_interfaces == 0:
        with_efa = sorted(name for name, t in GPU_INSTANCE_TYPES.items() if t.efa_interfaces)
        raise ConfigError(
            f"{_key('efa')} is true but {_key('gpuInstanceType')} {type_name} has no EFA interface: set "
            f"`pulumi config set efa false`, or choose a type with EFA ({', '.join(with_efa)})")

    shared = str(_string(values, "sharedFileSystem", "fsx-lustre"))
    if shared not in SHARED_FILESYSTEMS:
        raise ConfigError(f"{_key('sharedFileSystem')} is '{shared}': choose one of {', '.join(SHARED_FILESYSTEMS)}")
    fsx_capacity = _int(values, "fsxStorageCapacityGb", 1200)
    if shared == "fsx-lustre" and not (fsx_capacity == 1200 or (fsx_capacity > 0 and fsx_capacity % 2400 == 0)):
        raise ConfigError(
            f"{_key('fsxStorageCapacityGb')} is {fsx_capacity}: FSx for Lustre (PERSISTENT_2, SSD) takes 1200 "
            "or a multiple of 2400 GB")
    fsx_throughput = _int(values, "fsxThroughputMbPerTib", 250)
    if shared == "fsx-lustre" and fsx_throughput not in FSX_THROUGHPUTS_MB_PER_TIB:
        raise ConfigError(
            f"{_key('fsxThroughputMbPerTib')} is {fsx_throughput}: choose one of "
            f"{', '.join(map(str, FSX_THROUGHPUTS_MB_PER_TIB))} MB/s per TiB")

    gpu_root = _int(values, "gpuRootVolumeGb", 500)
    head_root = _int(values, "headRootVolumeGb", 200)
    for name, size in (("gpuRootVolumeGb", gpu_root), ("headRootVolumeGb", head_root)):
        if not 50 <= size <= 16384:
            raise ConfigError(f"{_key(name)} is {size}: a root volume takes 50 to 16384 GB (drivers and CUDA need ~30)")

    ami_id = _string(values, "amiId", None) or None
    if ami_id is not None and not _AMI_ID.match(ami_id):
        raise ConfigError(f"{_key('amiId')} is '{ami_id}': an image id looks like ami-0123456789abcdef0; "
                          "leave it unset to use Canonical's latest Ubuntu 22.04")

    tags = NAMESPACE.mapping(values, "tags", what="tag names", example="{team: vision, cost-center: research}")
    for name, value in tags.items():
        # EC2's limits; `aws:` is AWS's own prefix and the stack's own tags would silently win over these.
        if not 1 <= len(name) <= 128 or len(value) > 256 or name.lower().startswith("aws:"):
            raise ConfigError(f"{_key('tags')}.{name}: a tag name has 1 to 128 characters and does not start with "
                              "aws:, its value at most 256")

    head_type = str(_string(values, "headInstanceType", "m7i.2xlarge"))
    if not _INSTANCE_TYPE.match(head_type):
        raise ConfigError(f"{_key('headInstanceType')} is '{head_type}': give an EC2 instance type such as "
                          "m7i.2xlarge")
    ssh_user = str(_string(values, "sshUser", "ubuntu"))
    if not _LINUX_USER.match(ssh_user):
        raise ConfigError(f"{_key('sshUser')} is '{ssh_user}': give the image's login user, a Linux user name such "
                          "as ubuntu (lower-case letters, digits, _ and -)")

    admin_cidrs = _admin_cidrs(values)

    return AwsClusterConfig(
        cluster_name=cluster_name,
        availability_zone=str(zone),
        admin_cidrs=admin_cidrs,
        ssh_public_key=ssh_public_key,
        gpu_instance_type=instance_type,
        gpu_node_count=count,
        vpc_cidr=_network(values),
        purchase_option=purchase,
        capacity_reservation_id=str(reservation) if reservation else None,
        spot_max_price=str(spot_max_price) if spot_max_price is not None else None,
        efa=efa,
        gpu_root_volume_gb=gpu_root,
        head_instance_type=head_type,
        head_root_volume_gb=head_root,
        ami_id=str(ami_id) if ami_id else None,
        ssh_user=ssh_user,
        shared_filesystem=shared,
        fsx_storage_capacity_gb=fsx_capacity,
        fsx_throughput_mb_per_tib=fsx_throughput,
        tags=tags,
    )


CONFIG_KEYS = (
    "clusterName", "availabilityZone", "adminCidrs", "sshPublicKey", "gpuInstanceType", "gpuNodeCount", "vpcCidr",
    "purchaseOption", "capacityReservationId", "spotMaxPrice", "efa", "gpuRootVolumeGb", "headInstanceType",
    "headRootVolumeGb", "amiId", "sshUser", "sharedFileSystem", "fsxStorageCapacityGb", "fsxThroughputMbPerTib", "tags",
)


def load_config() -> AwsClusterConfig:
    """Read every setting of this stack's namespace (lists and maps come back as objects) and validate them."""
    return parse_config(NAMESPACE.read(STRUCTURED_KEYS))
