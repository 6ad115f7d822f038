"""The preflight playbook against a good inventory and many bad ones.

The "nodes" are this machine reached with the local connection under three loopback addresses
(127.0.0.1-3), so the real role runs (its probes and its pings) without containers. Every bad
inventory must stop with its own message, naming what is wrong and the fix, and no Python traceback.
"""
from __future__ import annotations

import re

import pytest
from preflight_support import GOOD, REPO, assert_stopped_cleanly, run_preflight, variant


def test_good_inventory_passes(tmp_path):
    result = run_preflight(tmp_path, GOOD)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "failed=0" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


BAD = {
    "missing_head_group": (
        variant(**{"children.head": None}),
        ["group 'head' is missing", "hosts.yml"]),
    "two_heads": (
        variant(**{"children.head": {"hosts": {"n1": None, "n2": None}}}),
        ["group 'head' has 2 hosts (n1, n2)", "exactly one head"]),
    "empty_gpu_nodes": (
        variant(**{"children.gpu_nodes": {"hosts": {}}}),
        ["group 'gpu_nodes' has no hosts"]),
    "duplicate_address": (
        variant(**{"hosts.n3.ansible_host": "127.0.0.2"}),
        ["host n3: address 127.0.0.2 is also used by n2"]),
    "address_outside_cidr": (
        variant(**{"hosts.n2.cluster_address": "10.99.0.5"}),
        ["host n2: address 10.99.0.5 is outside cluster_network_cidr 127.0.0.0/8"]),
    "not_an_address": (
        variant(**{"hosts.n3.ansible_host": "gpu-three.example"}),
        ["host n3: address 'gpu-three.example' is not an IP address"]),
    "invalid_cidr": (
        variant(**{"vars.cluster_network_cidr": "127.0.0.1/8"}),
        ["cluster_network_cidr is '127.0.0.1/8', not a network"]),
    "unknown_backend": (
        variant(**{"vars.cluster_storage_backend": "ceph"}),
        ["cluster_storage_backend", "ceph", "glusterfs, nfs"]),
    "replica_above_storage_nodes": (
        variant(**{"vars.cluster_storage_replica": 4}),
        ["cluster_storage_replica is 4 but storage_nodes has only 3 host(s)"]),
    "bricks_not_multiple_of_replica": (
        variant(**{"vars.cluster_storage_replica": 2}),
        ["3 bricks", "not a multiple of cluster_storage_replica 2"]),
    "mtu_too_large": (
        variant(**{"vars.cluster_mtu": 65000}),
        ["cluster_mtu is 65000", "1280 to 9216"]),
    "mtu_not_a_number": (
        variant(**{"vars.cluster_mtu": "jumbo"}),
        ["cluster_mtu"]),
    "threshold_of_wrong_type": (
        variant(**{"vars.preflight_min_cpu_cores": "lots"}),
        ["preflight_min_cpu_cores"]),
    "node_memory_below_threshold": (
        variant(**{"vars.preflight_min_memory_gb": 100000}),
        ["n1 is not fit for the cluster", "preflight_min_memory_gb", "lower the threshold"]),
    "node_cpu_below_threshold": (
        variant(**{"vars.preflight_min_cpu_cores": 4096}),
        ["CPU cores, needs at least 4096 (preflight_min_cpu_cores)"]),
    "node_disk_below_threshold": (
        variant(**{"vars.preflight_min_free_disk_gb": 10 ** 9}),
        ["preflight_min_free_disk_gb", "point preflight_data_path at the data disk"]),
    "gpu_node_without_gpus": (
        variant(**{"vars.preflight_require_gpus": True}),
        ["n2 is not fit", "0 NVIDIA GPU(s) on the PCI bus", "preflight_min_gpus_per_node"]),
    "gpu_node_with_fewer_gpus_than_promised": (
        variant(**{"vars.cluster_gpus_per_node": 8}),
        ["n2 is not fit", "0 NVIDIA GPU(s) on the PCI bus, the inventory promises 8 (cluster_gpus_per_node)"]),
    "inference_port_below_1024": (
        variant(**{"vars.inference_enabled": True, "vars.inference_preset": "tiny", "vars.inference_base_port": 80}),
        ["The inference settings are not valid", "n2: inference_base_port is 80: use a value from 1024 to 65535"]),
    "inference_ports_over_node_exporter": (
        variant(**{"vars.inference_enabled": True, "vars.inference_preset": "tiny", "vars.inference_base_port": 9096,
                   "vars.cluster_gpus_per_node": 0, "hosts.n3.inference_gpus_per_node": 8}),
        ["n3: the workers' ports 9096-9103 include 9100, used by node_exporter"]),
    "inference_without_a_model": (
        variant(**{"vars.inference_enabled": True}),
        ["n2: neither inference_model_dir", "nor inference_preset"]),
    # Values that no check read, or that only a role read after earlier layers had changed the nodes.
    "users_duplicate_uid": (
        variant(**{"vars.cluster_users": [{"name": "a", "uid": 2001}, {"name": "b", "uid": 2001}]}),
        ["cluster_users[1] (b): uid 2001 is also the uid of a"]),
    "users_uid_zero": (
        variant(**{"vars.cluster_users": [{"name": "toor", "uid": 0}]}),
        ["cluster_users[0] (toor): uid is 0", "preflight_id_range"]),
    "users_name_with_space": (
        variant(**{"vars.cluster_users": [{"name": "jane doe", "uid": 2001}]}),
        ["name 'jane doe' is not a valid login name"]),
    "users_as_a_mapping": (
        variant(**{"vars.cluster_users": {"trainer": {"uid": 2001}}}),
        ["cluster_users is a mapping, not a list"]),
    "group_gid_of_the_system": (
        variant(**{"vars.cluster_group": {"name": "sd3", "gid": 100}}),
        ["cluster_group.gid is 100: use an id from 1000 to 59999"]),
    "shared_path_relative": (
        variant(**{"vars.cluster_shared_path": "shared"}),
        ["cluster_shared_path is 'shared', a relative path", "/shared"]),
    "bricks_per_node_zero": (
        variant(**{"vars.cluster_storage_bricks_per_node": 0}),
        ["cluster_storage_bricks_per_node is 0: it must be 1 or more"]),
    "cluster_name_with_space": (
        variant(**{"vars.cluster_name": "sd3 test"}),
        ["cluster_name is 'sd3 test'", "e.g. sd3-test"]),
    "host_name_not_a_hostname": (
        variant(**{"hosts.n3_gpu": {"ansible_host": "127.0.0.4"}}),
        ["host n3_gpu: 'n3_gpu' is not a valid host name"]),
    # Names that look like ours but that no spec declares: the closest declared name is offered.
    "misspelt_cluster_variable": (
        variant(**{"vars.cluster_mtuu": 1500}),
        ["cluster_mtuu is not a variable of this project", "did you mean cluster_mtu?"]),
    "misspelt_role_variable": (
        variant(**{"vars.preflight_min_cpu_core": 1}),
        ["preflight_min_cpu_core is not a variable", "did you mean preflight_min_cpu_cores?"]),
    "misspelt_variable_of_one_host": (
        variant(**{"hosts.n2.glusterfs_replicas": 2}),
        ["host n2: glusterfs_replicas is not a variable", "did you mean glusterfs_replica?"]),
    "misspelt_without_our_prefix": (
        variant(**{"vars.clustr_storage_replica": 3}),
        ["clustr_storage_replica is not a variable", "did you mean cluster_storage_replica?"]),
    # A role's variable of the wrong type, said before the first layer (the role's own check came mid-run).
    "role_dict_given_a_string": (
        variant(**{"vars.docker_daemon_options": "journald"}),
        ["argument 'docker_daemon_options' is of type str", "roles/docker/meta/argument_specs.yml"]),
    "role_choice_not_offered": (
        variant(**{"vars.nvidia_driver_source": "runfile"}),
        ["nvidia_driver_source", "roles/nvidia_driver/meta/argument_specs.yml"]),
    "role_list_items_missing_keys": (
        variant(**{"hosts.n2.gpu_users_users": [{"uid": 2001}]}),
        ["host n2: missing required arguments: name found in gpu_users_users"]),
    # Values that used to end in a traceback or an Ansible internal error.
    "value_that_cannot_be_templated": (
        variant(**{"vars.cluster_shared_path": "{{ shared_root_of_site }}"}),
        ["cluster_shared_path cannot be read ('shared_root_of_site' is undefined)"]),
    "users_item_not_a_mapping": (
        variant(**{"vars.cluster_users": ["trainer"]}),
        ["cluster_users[0] is 'trainer': each user is a mapping"]),
    "replica_not_a_number": (
        variant(**{"vars.cluster_storage_replica": "three"}),
        ["cluster_storage_replica is 'three', not a whole number"]),
    "latency_above_threshold": (
        variant(**{"vars.preflight_max_rtt_ms": 0.000001}),
        ["n1 -> n2 (127.0.0.2): round trip", "preflight_max_rtt_ms"]),
}


def test_good_inventory_with_serving_passes(tmp_path):
    result = run_preflight(tmp_path, variant(**{"vars.inference_enabled": True,
                                                "vars.inference_model_dir": "/shared/models/sd3"}))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Check the inference role's settings" in result.stdout


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inventory_stops_with_its_message(tmp_path, case):
    inventory, expected = BAD[case]
    result = run_preflight(tmp_path, inventory)
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"{case}: preflight passed\n{output}"
    for text in expected:
        assert text in output, f"{case}: {text!r} not in the output\n{output}"
    assert_stopped_cleanly(output)


def test_inventory_problems_are_reported_together(tmp_path):
    """A user fixes all inventory mistakes in one round, not one per run."""
    inventory = variant(**{"vars.cluster_mtu": 100, "hosts.n3.ansible_host": "127.0.0.2",
                           "children.head": {"hosts": {"n1": None, "n2": None}}})
    output = (result := run_preflight(tmp_path, inventory)).stdout + result.stderr
    assert result.returncode != 0
    assert "3 problem(s)" in output, output


def test_prod_example_inventory_passes_the_inventory_check(tmp_path):
    """The documented example is valid: no false alarm on a real inventory (its nodes are not contacted)."""
    result = run_preflight(tmp_path, REPO / "inventories" / "prod", "-c", "local", "-e", "preflight_check_nodes=false",
                           "-e", "preflight_check_network=false")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "List the problems of the inventory as a whole" in output
    assert re.search(r"^head01\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", output, flags=re.MULTILINE), output


def test_optional_cluster_variables_left_out_take_their_spec_defaults(tmp_path):
    """cluster_mtu, the storage counts and the users are optional (their specs give defaults): leaving them out
    once ended in "'cluster_mtu' is undefined" inside the network check."""
    inventory = variant(**{"vars.cluster_mtu": None, "vars.cluster_storage_replica": None,
                           "vars.cluster_storage_bricks_per_node": None})
    result = run_preflight(tmp_path, inventory)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "is undefined" not in output and "Traceback" not in output
    assert "Ping every other node" in output  # the check that read cluster_mtu ran
