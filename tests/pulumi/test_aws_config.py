"""pulumi/aws: a bad stack config stops with its message before any resource is declared."""

from __future__ import annotations

import runpy
import subprocess

import pulumi
import pytest
from sd3_aws.config import CONFIG_KEYS, ConfigError, parse_config
from sd3_pulumi_testing import AWS_VALUES, REPO, RecordingMocks

BAD_CONFIGS = [
    ({"gpuNodeCount": 0}, "gpuNodeCount is 0: a cluster has 1 to 64 GPU nodes"),
    ({"gpuNodeCount": 65}, "gpuNodeCount is 65"),
    ({"gpuNodeCount": "two"}, "not a whole number"),
    ({"gpuInstanceType": "p9.96xlarge"}, "gpuInstanceType is 'p9.96xlarge', which this stack does not know"),
    ({"adminCidrs": None}, "adminCidrs is missing"),
    ({"adminCidrs": []}, "adminCidrs is missing"),
    ({"adminCidrs": ["0.0.0.0/0"]}, "opens SSH to the whole internet"),
    ({"adminCidrs": ["203.0.113.0/24", "::/0"]}, "opens SSH to the whole internet"),
    ({"adminCidrs": ["203.0.113.5/24"]}, "not a network in CIDR form"),
    ({"availabilityZone": None}, "availabilityZone is missing"),
    ({"sshPublicKey": ""}, "sshPublicKey is missing: the key pair"),
    ({"clusterName": "SD3_cluster"}, "clusterName is 'SD3_cluster'"),
    ({"purchaseOption": "reserved"}, "purchaseOption is 'reserved': choose one of"),
    ({"purchaseOption": "capacity-block"}, "capacityReservationId is missing"),
    ({"purchaseOption": "capacity-reservation", "capacityReservationId": "r-123"}, "looks like cr-"),
    ({"capacityReservationId": "cr-0123456789abcdef0"}, "capacityReservationId is set but"),
    ({"spotMaxPrice": "10"}, "it applies to spot only"),
    ({"vpcCidr": "8.8.0.0/16"}, "use a private IPv4 network"),
    ({"vpcCidr": "10.0.0.0/8"}, "use a private IPv4 network"),
    ({"sharedFileSystem": "s3"}, "sharedFileSystem is 's3'"),
    ({"fsxStorageCapacityGb": 2000}, "takes 1200 or a multiple of 2400"),
    ({"fsxThroughputMbPerTib": 300}, "fsxThroughputMbPerTib is 300"),
    ({"gpuRootVolumeGb": 10}, "gpuRootVolumeGb is 10"),
    ({"amiId": "ubuntu"}, "amiId is 'ubuntu'"),
    ({"efa": "maybe"}, "efa is 'maybe': use true or false"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_is_refused_with_its_message(overrides, message):
    values = {**AWS_VALUES, **overrides}
    values = {key: value for key, value in values.items() if value is not None}
    with pytest.raises(ConfigError, match=None) as caught:
        parse_config(values)
    assert message in str(caught.value)
    assert str(caught.value).startswith("sd3-cluster-aws:")


def test_a_private_key_given_as_the_public_one_is_refused(tmp_path):
    """The likeliest mix-up: the private key file's text. The key is made here, so none is kept in the tree."""
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with pytest.raises(ConfigError) as caught:
        parse_config({**AWS_VALUES, "sshPublicKey": key.read_text()})
    assert "not an OpenSSH public key (a line such as ssh-ed25519" in str(caught.value)
    assert str(caught.value).startswith("sd3-cluster-aws:")


def test_good_config_reads_types_and_defaults():
    config = parse_config({**AWS_VALUES, "gpuNodeCount": "4", "efa": "false"})
    assert config.gpu_node_count == 4 and config.efa is False and config.efa_interfaces == 0
    assert config.gpu_instance_type.efa_interfaces == 32
    assert config.purchase_option == "on-demand" and config.shared_filesystem == "fsx-lustre"
    with pytest.raises(AttributeError):
        config.gpu_node_count = 8  # frozen


def _run_main(config: dict[str, str], mocks: RecordingMocks | None = None) -> RecordingMocks:
    mocks = mocks or RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="sd3-cluster-aws", stack="test", preview=False)
    pulumi.runtime.set_all_config(config)

    @pulumi.runtime.test
    def program():
        runpy.run_path(str(REPO / "pulumi" / "aws" / "__main__.py"), run_name="__main__")

    try:
        program()
    finally:
        pulumi.runtime.set_all_config({})
    return mocks


def _stack_config(**overrides: str) -> dict[str, str]:
    config = {
        "sd3-cluster-aws:availabilityZone": "us-east-1a",
        "sd3-cluster-aws:adminCidrs": '["203.0.113.0/24"]',
        "sd3-cluster-aws:sshPublicKey": AWS_VALUES["sshPublicKey"],
        "sd3-cluster-aws:gpuNodeCount": "2",
    }
    config.update({f"sd3-cluster-aws:{key}": value for key, value in overrides.items()})
    return config


def test_main_declares_the_stack_from_pulumi_config():
    mocks = _run_main(_stack_config(tags='{"team": "vision"}'))
    assert len(mocks.of_type("aws:ec2/instance:Instance")) == 3
    assert all(r.inputs["tags"]["team"] == "vision" for r in mocks.of_type("aws:ec2/instance:Instance"))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"gpuNodeCount": "0"}, "gpuNodeCount is 0"),
    ({"adminCidrs": '["0.0.0.0/0"]'}, "opens SSH to the whole internet"),
    ({"gpuInstanceType": "x1.32xlarge"}, "does not know"),
])
def test_main_stops_before_any_resource(overrides, message):
    with pytest.raises(pulumi.RunError, match=message):
        _run_main(_stack_config(**overrides))


def test_main_without_admin_cidr_declares_nothing():
    config = _stack_config()
    del config["sd3-cluster-aws:adminCidrs"]
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="sd3-cluster-aws", stack="test", preview=False)
    pulumi.runtime.set_all_config(config)
    try:
        with pytest.raises(pulumi.RunError, match="adminCidrs is missing"):
            runpy.run_path(str(REPO / "pulumi" / "aws" / "__main__.py"), run_name="__main__")
    finally:
        pulumi.runtime.set_all_config({})
    assert mocks.resources == []


# -- every key of the namespace is known, typed and in range ------------------------------------------------------
MORE_BAD_CONFIGS = [
    # Misspelled keys: their default would have been used without a word.
    ({"gpuNodeCont": 8}, "'gpuNodeCont' (did you mean 'gpuNodeCount'?)"),
    ({"admin_cidrs": ["203.0.113.0/24"]}, "'admin_cidrs' (did you mean 'adminCidrs'?)"),
    ({"EFA": "false"}, "'EFA' (did you mean 'efa'?)"),
    # Values that were taken as they came.
    ({"purchaseOption": "spot", "spotMaxPrice": "cheap"}, "spotMaxPrice is 'cheap': give USD per hour"),
    ({"purchaseOption": "spot", "spotMaxPrice": "0"}, "spotMaxPrice is '0'"),
    ({"headInstanceType": "a big one"}, "headInstanceType is 'a big one': give an EC2 instance type"),
    ({"sshUser": "Root User"}, "sshUser is 'Root User'"),
    ({"availabilityZone": "us-east-1"}, "availabilityZone is 'us-east-1': give a zone name"),
    ({"amiId": "ami-notanid"}, "amiId is 'ami-notanid'"),
    ({"tags": {"aws:owner": "me"}}, "tags.aws:owner"),
    ({"tags": {"team": {"name": "vision"}}}, "tags.team is {\"name\": \"vision\"}: each value of the map is one text"),
    ({"adminCidrs": "203.0.113.7/32"}, "adminCidrs is \"203.0.113.7/32\", not a list of text values"),
    ({"gpuNodeCount": 2.5}, "gpuNodeCount is '2.5', not a whole number"),
    ({"gpuNodeCount": True}, "gpuNodeCount is 'True', not a whole number"),
]


@pytest.mark.parametrize(("overrides", "message"), MORE_BAD_CONFIGS, ids=[m for _, m in MORE_BAD_CONFIGS])
def test_every_setting_is_checked(overrides, message):
    with pytest.raises(ConfigError) as caught:
        parse_config({**AWS_VALUES, **overrides})
    assert message in str(caught.value)
    assert "sd3-cluster-aws:" in str(caught.value)


def test_unknown_key_lists_the_known_keys_closest_first():
    with pytest.raises(ConfigError) as caught:
        parse_config({**AWS_VALUES, "gpuInstanceTyp": "p5.48xlarge"})
    listed = str(caught.value).split("closest first: ", 1)[1].split(", ")
    assert listed[0] == "gpuInstanceType"
    assert set(listed) == set(CONFIG_KEYS)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"gpuNodeCounts": "8"}, "'gpuNodeCounts' (did you mean 'gpuNodeCount'?)"),
    ({"sharedFilesystem": "efs"}, "'sharedFilesystem' (did you mean 'sharedFileSystem'?)"),
    ({"availabilityZone": "us-east-1"}, "sd3-cluster-aws:availabilityZone is 'us-east-1'"),
    ({"purchaseOption": "spot", "spotMaxPrice": "$40"}, "sd3-cluster-aws:spotMaxPrice is '$40'"),
])
def test_main_refuses_what_it_used_to_accept_before_any_resource(overrides, message):
    """What `pulumi up` runs: every key of the namespace is read, so a misspelled one cannot hide behind its
    default, and every value is checked; the stop is Pulumi's RunError with our message alone (no traceback)."""
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as caught:
        _run_main(_stack_config(**overrides), mocks)
    assert message in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert mocks.resources == []


# -- a list or map given as plain text: explained, not Pulumi's bare ConfigTypeError ------------------------------
@pytest.mark.parametrize(("overrides", "message"), [
    ({"adminCidrs": "203.0.113.7/32"},
     "sd3-cluster-aws:adminCidrs is '203.0.113.7/32', plain text, but it is a list of networks; set it as a list: "
     "`pulumi config set --path 'adminCidrs[0]' 203.0.113.7/32`"),
    ({"adminCidrs": "203.0.113.7/32,198.51.100.0/24"}, "'adminCidrs[1]' for a second network"),
    ({"tags": "team=vision"}, "sd3-cluster-aws:tags is 'team=vision', plain text, but it is a map of tag names to "
     "values: `pulumi config set --path tags.team vision`"),
])
def test_plain_text_for_a_list_or_map_is_explained(overrides, message):
    mocks = RecordingMocks()
    with pytest.raises(pulumi.RunError) as caught:
        _run_main(_stack_config(**overrides), mocks)
    assert not isinstance(caught.value, pulumi.ConfigTypeError)
    assert message in str(caught.value)
    # RunError prints its message alone; a cause or context would bring the traceback back.
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert mocks.resources == []
