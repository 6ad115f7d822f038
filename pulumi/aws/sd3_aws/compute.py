"""The machines: a head node (the only SSH entry) and the GPU nodes in a cluster placement group."""

from __future__ import annotations

import pulumi
import pulumi_aws as aws
import pulumi_tls as tls

from .config import AwsClusterConfig
from .host_keys import host_key_of, node_host_key
from .tags import cluster_tags
from .userdata import cloud_init

CANONICAL_OWNER_ID = "099720109477"
UBUNTU_2204_AMI_NAME = "ubuntu/images/hvm-ssd*/ubuntu-jammy-22.04-amd64-server-*"


def ubuntu_ami(config: AwsClusterConfig, parent: pulumi.Resource) -> pulumi.Input[str]:
    """The configured image, or Canonical's newest Ubuntu 22.04 for x86_64 in this region."""
    if config.ami_id:
        return config.ami_id
    return aws.ec2.get_ami_output(
        most_recent=True,
        owners=[CANONICAL_OWNER_ID],
        filters=[
            aws.ec2.GetAmiFilterArgs(name="name", values=[UBUNTU_2204_AMI_NAME]),
            aws.ec2.GetAmiFilterArgs(name="architecture", values=["x86_64"]),
            aws.ec2.GetAmiFilterArgs(name="virtualization-type", values=["hvm"]),
        ],
        opts=pulumi.InvokeOutputOptions(parent=parent),
    ).id


def _user_data(config: AwsClusterConfig, hostname: str, key: tls.PrivateKey) -> pulumi.Output[str]:
    # A secret: it holds the node's private host key (see host_keys.py).
    return pulumi.Output.secret(host_key_of(key, hostname).apply(lambda k: cloud_init(hostname, k, config.ssh_user)))


def _metadata_options() -> aws.ec2.LaunchTemplateMetadataOptionsArgs:
    # IMDSv2 only; hop limit 2 lets containers on the node (the GPU operator, DCGM) read instance metadata.
    return aws.ec2.LaunchTemplateMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required",
                                                     http_put_response_hop_limit=2)


def network_interfaces(efa_interfaces: int, efa_only_secondaries: bool, subnet_id: pulumi.Input[str],
                       security_group_ids: list[pulumi.Input[str]]) -> list[aws.ec2.LaunchTemplateNetworkInterfaceArgs]:
    """One interface per network card: card 0 carries the node's address, the rest EFA traffic only."""
    if efa_interfaces == 0:
        return [aws.ec2.LaunchTemplateNetworkInterfaceArgs(
            device_index=0, network_card_index=0, subnet_id=subnet_id, security_groups=security_group_ids,
            delete_on_termination="true")]
    interfaces = []
    for card in range(efa_interfaces):
        secondary = card > 0
        interfaces.append(aws.ec2.LaunchTemplateNetworkInterfaceArgs(
            device_index=1 if secondary else 0,
            network_card_index=card,
            interface_type="efa-only" if secondary and efa_only_secondaries else "efa",
            subnet_id=subnet_id,
            security_groups=security_group_ids,
            delete_on_termination="true",
        ))
    return interfaces


def market_options(config: AwsClusterConfig) -> dict[str, object]:
    """Launch template arguments for how the capacity is bought."""
    if config.purchase_option == "spot":
        return {"instance_market_options": aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(
            market_type="spot",
            spot_options=aws.ec2.LaunchTemplateInstanceMarketOptionsSpotOptionsArgs(
                spot_instance_type="one-time", instance_interruption_behavior="terminate",
                max_price=config.spot_max_price))}
    if config.purchase_option in ("capacity-reservation", "capacity-block"):
        target = aws.ec2.LaunchTemplateCapacityReservationSpecificationArgs(
            capacity_reservation_target=aws.ec2.LaunchTemplateCapacityReservationSpecificationCapacityReservationTargetArgs(
                capacity_reservation_id=config.capacity_reservation_id))
        options: dict[str, object] = {"capacity_reservation_specification": target}
        if config.purchase_option == "capacity-block":
            options["instance_market_options"] = aws.ec2.LaunchTemplateInstanceMarketOptionsArgs(
                market_type="capacity-block")
        return options
    return {}


class HeadNode(pulumi.ComponentResource):
    """The head: Slurm controller, monitoring, NFS server when chosen, and the SSH entry (an Elastic IP)."""

    def __init__(self, name: str, config: AwsClusterConfig, hostname: str, subnet_id: pulumi.Input[str],
                 security_group_ids: list[pulumi.Input[str]], key_name: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:aws:HeadNode", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.hostname = hostname
        self.host_key = node_host_key(f"{name}-host-key", self)
        self.instance = aws.ec2.Instance(
            f"{name}-instance",
            ami=ubuntu_ami(config, self),
            instance_type=config.head_instance_type,
            subnet_id=subnet_id,
            vpc_security_group_ids=security_group_ids,
            key_name=key_name,
            user_data=_user_data(config, hostname, self.host_key),
            root_block_device=aws.ec2.InstanceRootBlockDeviceArgs(
                volume_size=config.head_root_volume_gb, volume_type="gp3", encrypted=True, delete_on_termination=True),
            metadata_options=aws.ec2.InstanceMetadataOptionsArgs(http_endpoint="enabled", http_tokens="required"),
            tags=cluster_tags(config.cluster_name, "head", hostname, config.tags),
            opts=child)
        self.public_address = aws.ec2.Eip(
            f"{name}-eip", domain="vpc", instance=self.instance.id,
            tags=cluster_tags(config.cluster_name, "head-eip", extra=config.tags), opts=child)
        self.register_outputs({
            "instance_id": self.instance.id,
            "private_ip": self.instance.private_ip,
            "public_ip": self.public_address.public_ip,
        })


class GpuNodes(pulumi.ComponentResource):
    """The GPU nodes: a cluster placement group, one launch template (EFA interfaces, purchase option, root
    volume) and one instance per node, each named as the inventory names it."""

    def __init__(self, name: str, config: AwsClusterConfig, hostnames: list[str], subnet_id: pulumi.Input[str],
                 security_group_ids: list[pulumi.Input[str]], key_name: pulumi.Input[str],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:aws:GpuNodes", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        instance_type = config.gpu_instance_type

        self.placement_group = aws.ec2.PlacementGroup(
            f"{name}-placement", strategy="cluster",
            tags=cluster_tags(config.cluster_name, "placement-group", extra=config.tags), opts=child)

        self.launch_template = aws.ec2.LaunchTemplate(
            f"{name}-template",
            description=(f"{config.cluster_name}: {instance_type.name} GPU node, "
                         f"{config.efa_interfaces} EFA interface(s)"),
            image_id=ubuntu_ami(config, self),
            instance_type=instance_type.name,
            key_name=key_name,
            ebs_optimized="true",
            network_interfaces=network_interfaces(config.efa_interfaces, instance_type.efa_only_secondaries,
                                                  subnet_id, security_group_ids),
            placement=aws.ec2.LaunchTemplatePlacementArgs(group_name=self.placement_group.name,
                                                          availability_zone=config.availability_zone),
            block_device_mappings=[aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
                device_name="/dev/sda1",
                ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
                    volume_size=config.gpu_root_volume_gb, volume_type="gp3", encrypted="true",
                    delete_on_termination="true"))],
            metadata_options=_metadata_options(),
            tag_specifications=[aws.ec2.LaunchTemplateTagSpecificationArgs(
                resource_type="volume", tags=cluster_tags(config.cluster_name, "gpu-node-volume", extra=config.tags))],
            tags=cluster_tags(config.cluster_name, "gpu-node-template", extra=config.tags),
            **market_options(config),
            opts=child)

        self.host_keys = [node_host_key(f"{hostname}-host-key", self) for hostname in hostnames]
        self.instances = [
            aws.ec2.Instance(
                hostname,
                # $Latest: a changed template applies to nodes added later and never replaces running ones.
                launch_template=aws.ec2.InstanceLaunchTemplateArgs(id=self.launch_template.id, version="$Latest"),
                user_data=_user_data(config, hostname, key),
                tags=cluster_tags(config.cluster_name, "gpu-node", hostname, config.tags),
                opts=child)
            for hostname, key in zip(hostnames, self.host_keys, strict=True)
        ]
        self.hostnames = hostnames
        self.register_outputs({
            "placement_group": self.placement_group.name,
            "instance_ids": [instance.id for instance in self.instances],
            "private_ips": [instance.private_ip for instance in self.instances],
        })
