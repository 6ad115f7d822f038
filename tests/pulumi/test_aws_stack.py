"""pulumi/aws under mocks: what is declared, with the properties that matter for a training cluster."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest
import yaml
from sd3_aws.compute import CANONICAL_OWNER_ID
from sd3_aws.config import ConfigError, parse_config
from sd3_aws.stack import build
from sd3_pulumi_testing import AWS_VALUES, declare, integral

INSTANCE = "aws:ec2/instance:Instance"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"


def _declare(pulumi_mocks, **overrides):
    config = parse_config({**AWS_VALUES, **overrides})
    outputs = declare(lambda: build(config)["ansible_inventory"])
    return config, outputs


def test_resource_counts(pulumi_mocks):
    _declare(pulumi_mocks)
    counts = {typ: len(pulumi_mocks.of_type(typ)) for typ in (
        "aws:ec2/vpc:Vpc", "aws:ec2/subnet:Subnet", "aws:ec2/placementGroup:PlacementGroup", LAUNCH_TEMPLATE,
        INSTANCE, SECURITY_GROUP, "aws:ec2/keyPair:KeyPair", "aws:ec2/natGateway:NatGateway",
        "aws:fsx/lustreFileSystem:LustreFileSystem", "aws:efs/fileSystem:FileSystem")}
    assert counts == {
        "aws:ec2/vpc:Vpc": 1, "aws:ec2/subnet:Subnet": 2, "aws:ec2/placementGroup:PlacementGroup": 1,
        LAUNCH_TEMPLATE: 1, INSTANCE: 4, SECURITY_GROUP: 2, "aws:ec2/keyPair:KeyPair": 1,
        "aws:ec2/natGateway:NatGateway": 1, "aws:fsx/lustreFileSystem:LustreFileSystem": 1,
        "aws:efs/fileSystem:FileSystem": 0,
    }
    components = {r.typ for r in pulumi_mocks.resources if not r.custom}
    assert components >= {"sd3cluster:aws:ClusterNetwork", "sd3cluster:aws:ClusterAccess", "sd3cluster:aws:HeadNode",
                          "sd3cluster:aws:GpuNodes", "sd3cluster:aws:SharedFileSystem"}


def test_subnets_share_the_configured_zone(pulumi_mocks):
    _declare(pulumi_mocks)
    subnets = pulumi_mocks.of_type("aws:ec2/subnet:Subnet")
    assert {s.inputs["availabilityZone"] for s in subnets} == {"us-east-1a"}
    assert not any(s.inputs.get("mapPublicIpOnLaunch") for s in subnets)


def test_placement_group_is_cluster_strategy_and_used_by_the_nodes(pulumi_mocks):
    _declare(pulumi_mocks)
    (group,) = pulumi_mocks.of_type("aws:ec2/placementGroup:PlacementGroup")
    assert group.inputs["strategy"] == "cluster"
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    assert template.inputs["placement"] == {"groupName": f"{group.name}-pg", "availabilityZone": "us-east-1a"}


@pytest.mark.parametrize(("instance_type", "efa"), [
    ("p5.48xlarge", 32), ("p5e.48xlarge", 32), ("p5en.48xlarge", 16), ("p4d.24xlarge", 4), ("p4de.24xlarge", 4),
    ("g6e.48xlarge", 4), ("g6e.12xlarge", 1), ("g6e.xlarge", 0),
])
def test_efa_interfaces_per_instance_type(pulumi_mocks, instance_type, efa):
    _declare(pulumi_mocks, gpuInstanceType=instance_type)
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    interfaces = integral(template.inputs["networkInterfaces"])
    assert template.inputs["instanceType"] == instance_type
    assert len(interfaces) == max(efa, 1)
    assert [i["networkCardIndex"] for i in interfaces] == list(range(len(interfaces)))
    efa_types = [i.get("interfaceType") for i in interfaces]
    if efa == 0:
        assert efa_types == [None]
    else:
        assert efa_types[0] == "efa"
        assert set(efa_types[1:]) <= {"efa", "efa-only"}
        assert [i["deviceIndex"] for i in interfaces] == [0] + [1] * (efa - 1)


def test_efa_can_be_switched_off(pulumi_mocks):
    _declare(pulumi_mocks, efa=False)
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    assert len(template.inputs["networkInterfaces"]) == 1
    assert "interfaceType" not in template.inputs["networkInterfaces"][0]


@pytest.mark.parametrize("count", [1, 2, 5])
def test_node_count(pulumi_mocks, count):
    _, inventory = _declare(pulumi_mocks, gpuNodeCount=count)
    gpu_instances = [r for r in pulumi_mocks.of_type(INSTANCE) if r.inputs["tags"]["sd3-cluster:role"] == "gpu-node"]
    assert len(gpu_instances) == count
    assert all(r.inputs["launchTemplate"]["version"] == "$Latest" for r in gpu_instances)
    # Registered as their user data (their host key) resolves, so in no fixed order.
    assert sorted(r.inputs["tags"]["Name"] for r in gpu_instances) == inventory["gpu_nodes"]["hosts"]
    assert all('hostname: "sd3-gpu-' in _secret(r.inputs["userData"]) for r in gpu_instances)


SECRET_SIG = "4dabf18193072939515e22adb298388d"  # Pulumi's marker of a secret value on the RPC boundary


def _secret(value):
    """The value of a secret input; fails when the input is not marked secret."""
    assert isinstance(value, dict) and SECRET_SIG in value, f"not a secret: {str(value)[:60]}"
    return value["value"]


def test_host_keys_in_user_data_match_the_inventory_known_hosts(pulumi_mocks, tmp_path):
    """Each node boots with the private host key (a tls.PrivateKey of its own, made at `pulumi up`) whose public
    half the inventory's known_hosts holds, checked with ssh-keygen; no two nodes share a key."""
    _, inventory = _declare(pulumi_mocks)
    lines = inventory["all"]["vars"]["pulumi_known_hosts"]
    known = {line.split()[0].split(",")[-1]: line.split()[1:3] for line in lines}
    instances = pulumi_mocks.of_type(INSTANCE)
    assert len(instances) == 4 and set(known) == {"sd3-head", "sd3-gpu-01", "sd3-gpu-02", "sd3-gpu-03"}
    for instance in instances:
        user_data = yaml.safe_load(_secret(instance.inputs["userData"]))
        host = user_data["hostname"]
        assert user_data["ssh_genkeytypes"] == [] and user_data["ssh_deletekeys"] is True
        key_file = tmp_path / host
        key_file.write_text(user_data["ssh_keys"]["ed25519_private"])
        key_file.chmod(0o600)
        derived = subprocess.run(["ssh-keygen", "-y", "-f", str(key_file)], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert derived[:2] == known[host] == user_data["ssh_keys"]["ed25519_public"].split()[:2]
    assert len({tuple(key) for key in known.values()}) == 4
    keys = pulumi_mocks.of_type("tls:index/privateKey:PrivateKey")
    assert len(keys) == 4 and {k.inputs["algorithm"] for k in keys} == {"ED25519"}


def test_ssh_options_are_strict_everywhere(pulumi_mocks):
    _, inventory = _declare(pulumi_mocks)
    for host, variables in inventory["_meta"]["hostvars"].items():
        args = variables["ansible_ssh_common_args"]
        assert "accept-new" not in args and "StrictHostKeyChecking=no" not in args, host
        # The node itself and the hop through the head both check against the stack's known_hosts alone.
        assert args.count("StrictHostKeyChecking=yes") == (2 if host != "sd3-head" else 1), host
        assert args.count("UserKnownHostsFile={{ pulumi_known_hosts_file }}") == args.count("StrictHostKeyChecking=yes")


def test_no_ingress_from_the_world(pulumi_mocks):
    _declare(pulumi_mocks, adminCidrs=["203.0.113.0/24", "198.51.100.7/32"])
    ingress_cidrs = []
    for group in pulumi_mocks.of_type(SECURITY_GROUP):
        for rule in group.inputs.get("ingress", []):
            ingress_cidrs += rule.get("cidrBlocks", []) + rule.get("ipv6CidrBlocks", [])
            if not rule.get("cidrBlocks"):
                assert rule.get("self") is True, rule
            else:
                assert (integral(rule["fromPort"]), integral(rule["toPort"]), rule["protocol"]) == (22, 22, "tcp")
    assert sorted(ingress_cidrs) == ["198.51.100.7/32", "203.0.113.0/24"]
    assert all(ipaddress.ip_network(c).prefixlen > 0 for c in ingress_cidrs)


def test_only_the_head_takes_ssh_from_outside(pulumi_mocks):
    _declare(pulumi_mocks)
    groups = pulumi_mocks.of_type(SECURITY_GROUP)
    ssh_group = next(g for g in groups if g.inputs["tags"]["sd3-cluster:role"] == "ssh-sg")
    head = next(r for r in pulumi_mocks.of_type(INSTANCE) if r.inputs["tags"]["sd3-cluster:role"] == "head")
    assert f"{ssh_group.name}-id" in head.inputs["vpcSecurityGroupIds"]
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    groups = {g for i in template.inputs["networkInterfaces"] for g in i["securityGroups"]}
    assert groups == {"sd3-cluster-id"}
    assert not any(i.get("associatePublicIpAddress") for i in template.inputs["networkInterfaces"])


def test_every_taggable_resource_carries_the_cluster_tags(pulumi_mocks):
    _declare(pulumi_mocks)
    tagged = [r for r in pulumi_mocks.resources if r.custom and "tags" in r.inputs]
    assert len(tagged) >= 15
    for resource in tagged:
        tags = resource.inputs["tags"]
        assert tags["sd3-cluster:cluster"] == "sd3", resource.name
        assert tags["project"] == "sd3-training", resource.name
        assert tags["ManagedBy"] == "pulumi"
    untagged = {r.typ for r in pulumi_mocks.resources if r.custom and "tags" not in r.inputs}
    # The host keys are no cloud resources: they live in the stack's state only.
    assert untagged <= {"aws:ec2/routeTableAssociation:RouteTableAssociation", "aws:efs/mountTarget:MountTarget",
                        "tls:index/privateKey:PrivateKey"}


def test_ubuntu_2204_from_canonical(pulumi_mocks):
    _declare(pulumi_mocks)
    lookups = [args for token, args in pulumi_mocks.calls if token == "aws:ec2/getAmi:getAmi"]
    assert lookups and all(args["owners"] == [CANONICAL_OWNER_ID] for args in lookups)
    assert any("ubuntu-jammy-22.04" in f["values"][0] for f in lookups[0]["filters"])
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    assert template.inputs["imageId"] == "ami-0ubuntu2204"


def test_configured_ami_skips_the_lookup(pulumi_mocks):
    _declare(pulumi_mocks, amiId="ami-0123456789abcdef0")
    assert not [token for token, _ in pulumi_mocks.calls if token == "aws:ec2/getAmi:getAmi"]


def test_on_demand_has_no_market_options(pulumi_mocks):
    _declare(pulumi_mocks)
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    assert "instanceMarketOptions" not in template.inputs
    assert "capacityReservationSpecification" not in template.inputs


def test_spot(pulumi_mocks):
    _declare(pulumi_mocks, purchaseOption="spot", spotMaxPrice="40.0")
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    market = template.inputs["instanceMarketOptions"]
    assert market["marketType"] == "spot"
    assert market["spotOptions"]["maxPrice"] == "40.0"


@pytest.mark.parametrize(("option", "market"), [("capacity-reservation", None), ("capacity-block", "capacity-block")])
def test_capacity_reservations(pulumi_mocks, option, market):
    _declare(pulumi_mocks, purchaseOption=option, capacityReservationId="cr-0123456789abcdef0")
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    target = template.inputs["capacityReservationSpecification"]["capacityReservationTarget"]
    assert target == {"capacityReservationId": "cr-0123456789abcdef0"}
    assert template.inputs.get("instanceMarketOptions", {}).get("marketType") == market


def test_root_volumes(pulumi_mocks):
    _declare(pulumi_mocks, gpuRootVolumeGb=800, headRootVolumeGb=120)
    (template,) = pulumi_mocks.of_type(LAUNCH_TEMPLATE)
    (mapping,) = template.inputs["blockDeviceMappings"]
    assert integral(mapping["ebs"]["volumeSize"]) == 800 and mapping["ebs"]["volumeType"] == "gp3"
    head = next(r for r in pulumi_mocks.of_type(INSTANCE) if r.inputs["tags"]["sd3-cluster:role"] == "head")
    assert integral(head.inputs["rootBlockDevice"]["volumeSize"]) == 120


def test_fsx_lustre(pulumi_mocks):
    _, inventory = _declare(pulumi_mocks, fsxStorageCapacityGb=4800, fsxThroughputMbPerTib=500)
    (lustre,) = pulumi_mocks.of_type("aws:fsx/lustreFileSystem:LustreFileSystem")
    assert integral(lustre.inputs["storageCapacity"]) == 4800
    assert lustre.inputs["deploymentType"] == "PERSISTENT_2"
    assert lustre.inputs["securityGroupIds"] == ["sd3-cluster-id"]
    assert inventory["all"]["vars"]["pulumi_shared_filesystem"] == {
        "dns_name": "fs-0123.fsx.us-east-1.amazonaws.com", "mount_name": "abcdefgh"}
    assert inventory["all"]["vars"]["pulumi_storage_backend"] == "fsx_lustre"
    assert inventory["storage_nodes"]["hosts"] == []


def test_efs(pulumi_mocks):
    _, inventory = _declare(pulumi_mocks, sharedFileSystem="efs")
    assert len(pulumi_mocks.of_type("aws:efs/fileSystem:FileSystem")) == 1
    (target,) = pulumi_mocks.of_type("aws:efs/mountTarget:MountTarget")
    assert target.inputs["securityGroups"] == ["sd3-cluster-id"]
    assert not pulumi_mocks.of_type("aws:fsx/lustreFileSystem:LustreFileSystem")
    assert inventory["all"]["vars"]["pulumi_shared_filesystem"] == {"dns_name": "fs-0456.efs.us-east-1.amazonaws.com"}
    assert inventory["all"]["vars"]["pulumi_storage_backend"] == "efs"


def test_no_shared_filesystem(pulumi_mocks):
    _, inventory = _declare(pulumi_mocks, sharedFileSystem="none")
    assert not [r for r in pulumi_mocks.resources if r.typ.startswith(("aws:efs", "aws:fsx"))]
    # No AWS file system: the head exports one over NFS (no GlusterFS: the instances have no brick disks).
    assert inventory["all"]["vars"]["pulumi_shared_filesystem"] == {}
    assert inventory["all"]["vars"]["pulumi_storage_backend"] == "nfs"
    assert inventory["storage_nodes"]["hosts"] == []


def test_inventory_output_matches_the_instances(pulumi_mocks):
    _, inventory = _declare(pulumi_mocks)
    hostvars = inventory["_meta"]["hostvars"]
    assert inventory["head"]["hosts"] == ["sd3-head"]
    assert inventory["gpu_nodes"]["hosts"] == ["sd3-gpu-01", "sd3-gpu-02", "sd3-gpu-03"]
    assert hostvars["sd3-head"]["ansible_host"].startswith("198.51.100.")
    network = ipaddress.ip_network(inventory["all"]["vars"]["pulumi_cluster_network_cidr"])
    assert all(ipaddress.ip_address(v["cluster_address"]) in network for v in hostvars.values())
    assert hostvars["sd3-gpu-02"]["efa_interfaces"] == 32
    assert hostvars["sd3-gpu-02"]["efa_device_rdma"] is True
    assert hostvars["sd3-gpu-02"]["cluster_gpus_per_node"] == 8
    assert "efa_interfaces" not in hostvars["sd3-head"]


@pytest.mark.parametrize(("settings", "interfaces", "device_rdma"), [
    ({"gpuInstanceType": "p5.48xlarge"}, 32, True),
    ({"gpuInstanceType": "p4d.24xlarge"}, 4, True),
    ({"gpuInstanceType": "g6e.48xlarge"}, 4, False),  # EFA, but no GPUDirect RDMA on the g-types
    ({"gpuInstanceType": "g6e.xlarge"}, 0, False),  # no EFA: unset efa follows the type
    ({"gpuInstanceType": "p5.48xlarge", "efa": False}, 0, False),
])
def test_efa_switches_give_the_nodes_their_efa_variables(pulumi_mocks, settings, interfaces, device_rdma):
    _, inventory = _declare(pulumi_mocks, **settings)
    for host in inventory["gpu_nodes"]["hosts"]:
        variables = inventory["_meta"]["hostvars"][host]
        assert (variables["efa_interfaces"], variables["efa_device_rdma"]) == (interfaces, device_rdma)


def test_efa_on_a_type_without_it_is_refused():
    with pytest.raises(ConfigError) as caught:
        parse_config({**AWS_VALUES, "gpuInstanceType": "g6e.xlarge", "efa": True})
    message = str(caught.value)
    assert message.startswith("sd3-cluster-aws:efa is true but sd3-cluster-aws:gpuInstanceType g6e.xlarge has no EFA")
    assert "`pulumi config set efa false`" in message and "p5.48xlarge" in message
