"""The firewall's rules (ansible/plugins/filter/firewall.py): services resolved from the roles' own variables, the
nftables rule set made from them, the check that a connection stays allowed, and bad inputs stopped with a message
before anything is applied. The rule sets are also checked by nft itself, in a network namespace of their own."""

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "ansible" / "plugins" / "filter" / "firewall.py"
spec = importlib.util.spec_from_file_location("firewall_filter", PLUGIN)
fw = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fw)

SERVICES = yaml.safe_load((REPO / "roles" / "firewall" / "defaults" / "main.yml").read_text())["firewall_services"]
ROLES = sorted({service["role"] for service in SERVICES if "role" in service})
GROUPS = {"all": ["head", "gpu1", "gpu2"], "head": ["head"], "gpu_nodes": ["gpu1", "gpu2"],
          "storage_nodes": ["head", "gpu1"]}
UNSET = fw.UNSET


def role_defaults():
    """The roles' defaults/main.yml as the role reads them (templated values replaced where a test needs them)."""
    defaults = {role: yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text()) for role in ROLES}
    defaults["inference"]["inference_gpus_per_node"] = 0  # "{{ cluster_gpus_per_node | default(0) }}"
    defaults["monitoring"]["monitoring_grafana_install"] = True
    return defaults


def values(**given):
    names = {name for service in SERVICES for key in ("ports", "port_range", "group_var", "enabled_var", "count_var")
             for name in (service.get(key) or []) if key == "ports"} | {
        service[key] for service in SERVICES for key in ("port_range", "group_var", "enabled_var", "count_var")
        if service.get(key)}
    out = dict.fromkeys(names, UNSET)
    out.update(cluster_storage_backend="glusterfs")
    out.update(given)
    return out


def services(host, **given):
    return {s["name"]: s["ports"] for s in
            fw.resolve_services(SERVICES, host, GROUPS, role_defaults(), values(**given), "32768 60999")}


def plan(host="head", **changes):
    base = {"table": "sd3_cluster_firewall", "admin_cidrs": ["192.0.2.0/24"],
            "node_addresses": ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "ssh_port": 22,
            "services": fw.resolve_services(SERVICES, host, GROUPS, role_defaults(), values(), "32768 60999"),
            "service_names": [s["name"] for s in SERVICES], "extra_rules": []}
    base.update(changes)
    return base


def test_the_head_opens_its_services_with_the_ports_of_their_roles():
    head = services("head")
    assert head["glusterd"] == [(24007, 24007)]
    assert head["glusterfs-bricks"] == [(49152, 60999)]
    assert head["slurmctld"] == [(6817, 6817)]
    assert head["prometheus"] == [(9090, 9090)]
    assert head["node_exporter"] == [(9100, 9100)]
    assert head["chrony"] == [(123, 123)]
    assert head["iperf3"] == [(5201, 5201)]
    assert head["grafana"] == [(3000, 3000)]
    assert head["nccl-gloo-srun-ephemeral"] == [(32768, 60999)]
    # Not the head's: slurmd and the rendezvous run on the gpu_nodes; NFS, slurmdbd, DCGM and serving are off.
    assert not {"slurmd", "torchrun-rendezvous", "nfs", "slurmdbd", "dcgm-exporter", "inference-balancer",
                "tensorboard"} & set(head)


def test_a_gpu_node_opens_slurmd_and_the_rendezvous_and_no_head_service():
    gpu = services("gpu2")
    assert gpu["slurmd"] == [(6818, 6818)] and gpu["torchrun-rendezvous"] == [(29400, 29400)]
    assert not {"prometheus", "slurmctld", "glusterd", "chrony"} & set(gpu)  # gpu2 holds no brick


def test_tensorboard_opens_on_the_head_only_when_its_role_is_switched_on():
    assert services("head", tensorboard_enabled=True)["tensorboard"] == [(6006, 6006)]
    assert services("head", tensorboard_enabled=True, tensorboard_port=6106)["tensorboard"] == [(6106, 6106)]
    assert "tensorboard" not in services("gpu1", tensorboard_enabled=True)


def test_the_rendezvous_follows_the_job_roles_group_and_port():
    moved = services("head", sd3_job_compute_group="head", sd3_job_rdzv_port=29500)
    assert moved["torchrun-rendezvous"] == [(29500, 29500)]
    assert "torchrun-rendezvous" not in services("gpu1", sd3_job_compute_group="head")


def test_a_port_the_inventory_sets_wins_over_the_role_default():
    assert services("head", monitoring_prometheus_port=9091)["prometheus"] == [(9091, 9091)]
    assert services("head", glusterfs_brick_port_range=[50000, 50100])["glusterfs-bricks"] == [(50000, 50100)]


def test_switches_and_groups_come_from_the_roles_variables():
    on = services("gpu1", inference_enabled=True, inference_gpus_per_node=8)
    assert on["inference-workers"] == [(8100, 8107)]
    assert services("head", inference_enabled=True)["inference-balancer"] == [(8080, 8080)]
    assert "inference-workers" not in services("head", inference_enabled=True)
    nfs = services("head", cluster_storage_backend="nfs")
    assert nfs["nfs"] == [(2049, 2049)] and "glusterd" not in nfs
    assert services("gpu1", monitoring_gpu_exporter="dcgm")["dcgm-exporter"] == [(9400, 9400)]


def test_the_rule_set_names_the_node_addresses_not_a_network():
    text = fw.render(plan())
    assert "elements = { 10.0.0.1, 10.0.0.2, 10.0.0.3 }" in text
    assert "policy drop;" in text
    assert 'tcp dport 22 accept comment "ssh"' in text
    assert 'ip saddr @admin_v4 tcp dport 22 accept comment "ssh"' in text
    assert 'ip saddr @nodes_v4 tcp dport 9090 accept comment "prometheus"' in text
    assert 'ip saddr @nodes_v4 udp dport 123 accept comment "chrony"' in text
    assert "10.0.0.0/24" not in text
    # Never the whole rule set: other tables (Docker's, the distribution's) stay.
    assert "flush ruleset" not in text
    assert text.startswith("table inet sd3_cluster_firewall\ndelete table inet sd3_cluster_firewall\n")


def test_the_digest_changes_with_the_rules_and_only_then():
    first, again = fw.render(plan()), fw.render(plan())
    other = fw.render(plan(node_addresses=["10.0.0.1", "10.0.0.2", "10.0.0.4"]))
    assert fw.ruleset_digest(first) == fw.ruleset_digest(again) != ""
    assert fw.ruleset_digest(first) != fw.ruleset_digest(other)


def test_extra_rules_open_ports_or_named_services_to_the_sources_given():
    text = fw.render(plan(extra_rules=[
        {"name": "office dashboards", "sources": ["198.51.100.0/24"], "services": ["prometheus", "inference-balancer"]},
        {"name": "web", "sources": "any", "ports": [80, 443, [8000, 8010]]},
        {"name": "admin metrics", "sources": ["admin"], "ports": 9100, "protocol": "tcp"}]))
    assert 'ip saddr { 198.51.100.0/24 } tcp dport 9090 accept comment "office dashboards (prometheus)"' in text
    assert "inference-balancer" not in text  # not served by this node: nothing to open
    assert 'tcp dport { 80, 443, 8000-8010 } accept comment "web"' in text
    assert 'ip saddr @admin_v4 tcp dport 9100 accept comment "admin metrics"' in text


def test_ipv6_nodes_and_admins_get_their_own_sets():
    text = fw.render(plan(admin_cidrs=["2001:db8:1::/64"], node_addresses=["10.0.0.1", "fd00::2"]))
    assert "type ipv6_addr" in text and "elements = { fd00::2 }" in text
    assert "ip6 saddr @admin_v6 tcp dport 22" in text and "ip saddr @admin_v4" not in text


@pytest.mark.parametrize(("source", "port", "allowed"), [
    ("192.0.2.9", 22, True),  # an admin network
    ("10.0.0.2", 22, True),  # a node
    ("10.0.0.2", 9090, True),
    ("10.0.0.77", 22, False),  # on the cluster network, not in the inventory
    ("10.0.0.77", 9090, False),
    ("192.0.2.9", 9090, False),  # admins reach SSH only
    ("203.0.113.5", 22, False),
])
def test_allows_says_which_connections_the_rules_let_in(source, port, allowed):
    assert fw.allows(plan(), source, port) is allowed


def test_an_extra_rule_for_the_admins_is_honoured_by_allows():
    extra = [{"name": "controller", "sources": ["admin"], "services": ["prometheus"]}]
    assert fw.allows(plan(extra_rules=extra), "192.0.2.9", 9090)


@pytest.mark.parametrize(("changes", "message"), [
    ({"admin_cidrs": ["office"]}, "cluster_admin_cidrs: 'office' is not a network; write one in CIDR form"),
    ({"admin_cidrs": ["192.0.2.1"]}, "'192.0.2.1' is an address, not a network; write 192.0.2.1/32"),
    ({"admin_cidrs": ["192.0.2.1/24"]}, "'192.0.2.1/24' has host bits set; the network is 192.0.2.0/24"),
    ({"admin_cidrs": "192.0.2.0/24"}, "cluster_admin_cidrs is '192.0.2.0/24': give a list of networks"),
    ({"extra_rules": [{"name": "web", "ports": "8000-8100"}]},
     "firewall_extra_rules 'web': the port range '8000-8100' is text; write it as a list of two numbers, [8000, 8100]"),
    ({"extra_rules": [{"name": "web", "ports": [[8100, 8000]]}]}, "the range [8100, 8000] ends before it starts"),
    ({"extra_rules": [{"name": "web", "ports": [70000]}]}, "port 70000 is outside 1-65535"),
    ({"extra_rules": [{"name": "web", "ports": [80], "protocol": "sctp"}]},
     "firewall_extra_rules 'web': protocol 'sctp' is not one of tcp, udp"),
    ({"extra_rules": [{"name": "web", "ports": [80], "sources": ["everyone"]}]},
     "firewall_extra_rules 'web' sources: 'everyone' is not a network"),
    ({"extra_rules": [{"name": "web", "services": ["grafna"]}]}, "no service 'grafna' in firewall_services"),
    ({"extra_rules": [{"name": "web", "sources": "any"}]}, "give ports (numbers or [first, last]) or services"),
    ({"extra_rules": [{"name": "web", "port": 80}]}, "unknown keys port"),
    ({"node_addresses": ["node1"]}, "'node1' is not an IP address"),
    ({"node_addresses": []}, "the inventory gives no node addresses"),
])
def test_bad_input_stops_with_a_message_naming_it(changes, message):
    with pytest.raises(fw.FirewallInputError) as err:
        fw.render(plan(**changes))
    assert message in str(err.value)


def test_a_port_range_variable_given_as_text_is_refused():
    with pytest.raises(fw.FirewallInputError, match=r"glusterfs_brick_port_range \(glusterfs role\): the port range "
                                                    r"'49152-60999' is text; write it as a list of two numbers"):
        services("head", glusterfs_brick_port_range="49152-60999")


def test_an_unknown_protocol_in_a_service_is_refused():
    with pytest.raises(fw.FirewallInputError, match="firewall_services 'x': protocol 'icmp' is not one of tcp, udp"):
        fw.resolve_services([{"name": "x", "role": "monitoring", "ports": ["monitoring_prometheus_port"],
                              "protocol": "icmp"}], "head", GROUPS, role_defaults(), values(), "32768 60999")


def test_a_service_naming_a_variable_its_role_lacks_is_refused():
    with pytest.raises(fw.FirewallInputError, match="the monitoring role has no variable monitoring_prometheus_prot"):
        fw.resolve_services([{"name": "x", "role": "monitoring", "ports": ["monitoring_prometheus_prot"]}],
                            "head", GROUPS, role_defaults(), {}, "32768 60999")


def test_the_ansible_filter_turns_input_errors_into_filter_errors():
    from ansible.errors import AnsibleFilterError
    with pytest.raises(AnsibleFilterError, match="firewall: cluster_admin_cidrs: 'x' is not a network"):
        fw.FilterModule().filters()["firewall_ruleset"](plan(admin_cidrs=["x"]))


NFT = shutil.which("nft") or "/usr/sbin/nft"


@pytest.mark.skipif(not Path(NFT).exists() or not shutil.which("unshare"), reason="needs nft and unshare")
@pytest.mark.parametrize("host", ["head", "gpu1"])
def test_nft_accepts_the_rule_sets_in_a_namespace_of_its_own(tmp_path, host):
    """nft -c parses and checks the rule set against the kernel, in a new network namespace (the host's rules are
    never touched, not even checked against)."""
    extra = [{"name": "office", "sources": ["198.51.100.0/24", "2001:db8::/32"], "services": ["prometheus"]},
             {"name": "web", "sources": "any", "ports": [80, [8000, 8010]], "protocol": "udp"}]
    text = fw.render(plan(host, admin_cidrs=["192.0.2.0/24", "2001:db8:1::/64"],
                          node_addresses=["10.0.0.1", "10.0.0.2", "fd00::3"], extra_rules=extra))
    rules = tmp_path / "rules.nft"
    rules.write_text(text)
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no network namespace can be made here: {probe.stderr.decode().strip()}")
    run = subprocess.run(["unshare", "--net", NFT, "-c", "-f", str(rules)], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr
    # Loaded and listed back in that namespace: the digest travels in the table's comment.
    listed = subprocess.run(["unshare", "--net", "sh", "-c", f"{NFT} -f {rules} && {NFT} list table inet "
                             "sd3_cluster_firewall"], capture_output=True, text=True, check=False)
    assert listed.returncode == 0, listed.stderr
    assert fw.ruleset_digest(listed.stdout) == fw.ruleset_digest(text)
