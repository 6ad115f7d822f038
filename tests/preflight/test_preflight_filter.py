"""The rules of ansible/plugins/filter/preflight.py, called directly: each bad input gives a problem that names
the variable (and, for a misspelt name, the closest declared one); good inputs give none."""

import runpy
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
_load = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
pf = _load("ansible/plugins/filter/preflight.py")

SPEC_FILES = [str(REPO / "roles" / "*" / "meta" / "argument_specs.yml"),
              str(REPO / "roles" / "day2" / "meta" / "argument_specs.yml")]
RULES = {"storage_backends": ["glusterfs", "nfs", "fsx_lustre", "efs"], "mtu_range": [1280, 9216],
         "required_groups": ["head", "gpu_nodes", "storage_nodes"], "id_range": [1000, 59999],
         "spec_files": SPEC_FILES}
GROUP = {"name": "sd3", "gid": 2000}
USERS = [{"name": "trainer", "uid": 2001, "admin": False, "docker": False}, {"name": "ops", "uid": 2002}]
GOOD_VARS = {"cluster_name": "sd3-test", "cluster_network_cidr": "10.0.0.0/24", "cluster_storage_backend": "glusterfs",
             "cluster_mtu": 9000, "cluster_storage_replica": 1, "cluster_storage_bricks_per_node": 1,
             "cluster_shared_path": "/shared", "cluster_group": GROUP, "cluster_users": USERS,
             "cluster_nodes_are_containers": False, "ansible_host": "10.0.0.1"}
GROUPS = {"all": ["n1"], "head": ["n1"], "gpu_nodes": ["n1"], "storage_nodes": ["n1"], "ungrouped": []}


@pytest.fixture(scope="module")
def known():
    return pf.known_variables(SPEC_FILES)


def problems_with(**changes):
    variables = dict(GOOD_VARS, **changes)
    return pf.inventory_problems(GROUPS, {"n1": {k: v for k, v in variables.items() if v is not None}}, RULES)


def test_good_variables_have_no_problem():
    assert problems_with() == []


def test_known_variables_come_from_every_spec(known):
    roles = {path.name for path in (REPO / "roles").iterdir() if (path / "meta" / "argument_specs.yml").is_file()}
    assert set(known["prefixes"]) >= roles | {"cluster", "day2", "verify"}
    for name in ("cluster_mtu", "preflight_min_cpu_cores", "glusterfs_replica", "day2_rolling_upgrade_batch",
                 "day2_remove_nodes"):
        assert name in known["names"]


@pytest.mark.parametrize(("name", "expected"), [
    ("cluster_mtuu", "did you mean cluster_mtu?"),
    ("clustre_mtu", "did you mean cluster_mtu?"),
    ("preflight_min_cpu_core", "did you mean preflight_min_cpu_cores?"),
    ("day2_rolling_upgrade_bacth", "did you mean day2_rolling_upgrade_batch?"),
    ("rolling_upgrade_batch", "did you mean day2_rolling_upgrade_batch?"),
    ("day2_remove_node", "did you mean day2_remove_nodes?"),
    ("glusterfs_replicas", "did you mean glusterfs_replica?"),
])
def test_misspelt_variable_names_the_closest_known_one(known, name, expected):
    (problem,) = pf.unknown_variable_problems([name, "ansible_host", "my_own_var"], known)
    assert problem.startswith(name) and problem.endswith(expected)


def test_private_and_foreign_variables_are_not_ours(known):
    # The pulumi_* and aws_* names are what inventories/cloud/pulumi_inventory.py gives every host.
    assert pf.unknown_variable_problems(["__preflight_x", "ansible_user", "pulumi_shared_filesystem",
                                         "verify_gpu_profile", "inventory_file", "pulumi_cluster_name",
                                         "pulumi_cluster_network_cidr", "pulumi_cluster_mtu", "pulumi_storage_replica",
                                         "aws_instance_type", "aws_efa_interfaces", "aws_gpus"], known) == []


@pytest.mark.parametrize(("changes", "expected"), [
    ({"cluster_users": [{"name": "a", "uid": 2001}, {"name": "b", "uid": 2001}]}, "uid 2001 is also the uid of a"),
    ({"cluster_users": [{"name": "root2", "uid": 0}]}, "cluster_users[0] (root2): uid is 0"),
    ({"cluster_users": [{"name": "jane doe", "uid": 2001}]}, "name 'jane doe' is not a valid login name"),
    ({"cluster_users": {"trainer": {"uid": 2001}}}, "cluster_users is a mapping, not a list"),
    ({"cluster_users": [{"name": "a", "uid": 2001}, {"name": "a", "uid": 2002}]}, "name a is also cluster_users[0]"),
    ({"cluster_users": [{"name": "a", "uid": "x"}]}, "uid is 'x', not a whole number"),
    ({"cluster_users": [{"name": "a", "uid": 2001, "sudo": True}]}, "unknown key 'sudo'"),
    ({"cluster_users": [{"name": "a", "uid": 2001, "admin": "yes"}]}, "admin is 'yes': write true or false"),
    ({"cluster_users": ["trainer"]}, "cluster_users[0] is 'trainer'"),
    ({"cluster_group": {"name": "sd3", "gid": 70000}}, "cluster_group.gid is 70000"),
    ({"cluster_group": {"name": "Sd 3", "gid": 2000}}, "cluster_group.name is 'Sd 3'"),
    ({"cluster_group": "sd3"}, "cluster_group is a string ('sd3')"),
    ({"cluster_shared_path": "shared"}, "cluster_shared_path is 'shared', a relative path"),
    ({"cluster_shared_path": "/"}, "cluster_shared_path is '/'"),
    ({"cluster_shared_path": "/data/../shared"}, "cluster_shared_path is '/data/../shared'"),
    ({"cluster_storage_bricks_per_node": 0}, "cluster_storage_bricks_per_node is 0: it must be 1 or more"),
    ({"cluster_storage_replica": -1}, "cluster_storage_replica is -1: it must be 1 or more"),
    ({"cluster_storage_replica": "three"}, "cluster_storage_replica is 'three', not a whole number"),
    ({"cluster_gpus_per_node": -2}, "cluster_gpus_per_node is -2"),
    ({"cluster_name": "sd3 prod"}, "cluster_name is 'sd3 prod': use letters, digits and '-'"),
    ({"cluster_name": None}, "cluster_name is not set"),
    ({"cluster_mtu": True}, "cluster_mtu is True"),
    ({"cluster_nodes_are_containers": "no"}, "cluster_nodes_are_containers is 'no'"),
    ({"cluster_network_cidr": None}, "cluster_network_cidr is 'undefined'"),
    ({"cluster_admin_cidrs": ["office"]}, "cluster_admin_cidrs: 'office' is not a network; write one in CIDR form"),
    ({"cluster_admin_cidrs": ["192.0.2.7"]}, "cluster_admin_cidrs: '192.0.2.7' is an address, not a network; write "
                                             "192.0.2.7/32"),
    ({"cluster_admin_cidrs": ["192.0.2.7/24"]}, "cluster_admin_cidrs: '192.0.2.7/24' has host bits set; the network "
                                                "is 192.0.2.0/24"),
    ({"cluster_admin_cidrs": "192.0.2.0/24"}, "cluster_admin_cidrs is '192.0.2.0/24': give a list of networks"),
])
def test_bad_cluster_variable_is_named(changes, expected):
    problems = problems_with(**changes)
    assert any(expected in problem for problem in problems), problems


def test_admin_networks_in_cidr_form_are_no_problem():
    assert problems_with(cluster_admin_cidrs=["192.0.2.0/24", "2001:db8::/64", "198.51.100.4/32"]) == []


def test_a_problem_of_some_hosts_names_them():
    groups = dict(GROUPS, all=["n1", "n2"], gpu_nodes=["n1", "n2"])
    hostvars = {"n1": dict(GOOD_VARS), "n2": dict(GOOD_VARS, ansible_host="10.0.0.2", cluster_mtu=100)}
    problems = pf.inventory_problems(groups, hostvars, RULES)
    assert [p for p in problems if "cluster_mtu" in p] == [
        "host n2: cluster_mtu is 100: use a value from 1280 to 9216 (1500 for plain Ethernet, 9000 for jumbo frames)"]


def test_a_value_that_cannot_be_templated_is_a_problem_not_a_traceback():
    class Exploding(dict):
        def __getitem__(self, key):
            if key == "cluster_mtu":
                raise RuntimeError("'mtu_of_site' is undefined")
            return super().__getitem__(key)
    problems = pf.inventory_problems(GROUPS, {"n1": Exploding(GOOD_VARS)}, RULES)
    assert problems == ["cluster_mtu cannot be read ('mtu_of_site' is undefined): fix its value in the inventory"]


def test_a_value_made_from_play_variables_is_left_to_the_play():
    """hostvars templates a host's value without the play's magic variables: a value built from them is valid in
    the play (the local inventory's backup_sftp_host), so it is not read here, while any other undefined name is."""
    class PlayOnly(dict):
        def __getitem__(self, key):
            if key == "backup_sftp_host":
                raise RuntimeError("'hostvars' is undefined")
            if key == "cluster_mtu":
                raise RuntimeError("'hostvarz' is undefined")
            return super().__getitem__(key)
    problems = pf.inventory_problems(GROUPS, {"n1": PlayOnly(GOOD_VARS, backup_sftp_host="x")}, RULES)
    assert problems == ["cluster_mtu cannot be read ('hostvarz' is undefined): fix its value in the inventory"]


def test_no_spec_found_is_said():
    problems = pf.inventory_problems(GROUPS, {"n1": GOOD_VARS}, dict(RULES, spec_files=["/nonexistent/*.yml"]))
    assert len(problems) == 1 and "no argument specs were found" in problems[0]


@pytest.mark.parametrize(("knobs", "expected"), [
    ({"day2_rolling_upgrade_batch": "150%"}, "day2_rolling_upgrade_batch is '150%'"),
    ({"day2_rolling_upgrade_batch": 0}, "day2_rolling_upgrade_batch is '0'"),
    ({"day2_rolling_upgrade_batch": "two"}, "day2_rolling_upgrade_batch is 'two'"),
    ({"day2_rolling_upgrade_drain_timeout": -5},
     "day2_rolling_upgrade_drain_timeout is -5: give a number of seconds, 0 or more"),
    ({"day2_rolling_upgrade_reboot_timeout": 0},
     "day2_rolling_upgrade_reboot_timeout is 0: give a number of seconds, 1 or more"),
])
def test_bad_day2_knob_is_named(knobs, expected):
    problems = pf.day2_problems(knobs, {}, ["n1"])
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("batch", [1, "3", "25%", "100%", None])
def test_good_batches_pass(batch):
    assert pf.day2_problems({"day2_rolling_upgrade_batch": batch}, {}, ["n1"]) == []


def test_day2_targets_must_match_and_lie_inside_the_limit():
    assert pf.day2_problems({}, {"day2_rolling_upgrade_hosts gpu": []}, ["n1"]) == [
        "day2_rolling_upgrade_hosts gpu matches no host of the inventory: name hosts or groups that the inventory has "
        "(ansible-inventory --graph lists them)"]
    (problem,) = pf.day2_problems({}, {"day2_remove_nodes n3": ["n3"]}, ["n1", "n2"])
    assert "day2_remove_nodes n3 (n3) lies outside --limit (n1, n2)" in problem
    assert pf.day2_problems({}, {"day2_remove_nodes n3": ["n3"]}, ["n3"]) == []


def _example_variable_names():
    """The variables set by the project's own inventories and molecule scenarios (none may read as a typo)."""
    names = set()
    for path in (REPO / "inventories").glob("*/group_vars/**/*.yml"):
        names.update(yaml.safe_load(path.read_text()) or {})
    for path in (REPO / "molecule").glob("*/molecule.yml"):
        inventory = ((yaml.safe_load(path.read_text()) or {}).get("provisioner") or {}).get("inventory") or {}
        for level in ("group_vars", "host_vars"):
            for variables in (inventory.get(level) or {}).values():
                names.update(variables or {})
    return names


def test_the_projects_own_inventories_have_no_unknown_variable(known):
    names = _example_variable_names()
    assert {"cluster_name", "cluster_users", "preflight_min_cpu_cores"} <= names  # the walk found them
    assert pf.unknown_variable_problems(names, known) == []


def test_role_variables_are_checked_against_their_specs():
    entries = pf.spec_entries(SPEC_FILES)
    problems = pf.spec_value_problems({"docker_daemon_options": ["x"], "slurm_gres_mode": "cuda",
                                       "preflight_min_cpu_cores": 4}, entries)
    assert any("docker_daemon_options" in p and "roles/docker/meta/argument_specs.yml" in p for p in problems)
    assert any("slurm_gres_mode must be one of: auto, nvml, static, none" in p for p in problems), problems
    assert len(problems) == 2  # preflight_min_cpu_cores is fine


def test_the_local_inventorys_values_fit_the_specs():
    """The values of inventories/local (those without a template, which only Ansible can resolve)."""
    variables = {}
    for path in (REPO / "inventories" / "local" / "group_vars").glob("**/*.yml"):
        variables.update({name: value for name, value in (yaml.safe_load(path.read_text()) or {}).items()
                          if "{{" not in str(value)})
    assert len(variables) > 20
    assert pf.spec_value_problems(variables, pf.spec_entries(SPEC_FILES)) == []


def _molecule_inventory(path):
    """groups and variables (those without a template) of a molecule scenario, as Ansible would give them."""
    scenario = yaml.safe_load(path.read_text())
    inventory = (scenario.get("provisioner") or {}).get("inventory") or {}
    group_vars, host_vars = inventory.get("group_vars") or {}, inventory.get("host_vars") or {}
    groups, hostvars = {"all": []}, {}
    for platform in scenario["platforms"]:
        groups["all"].append(platform["name"])
        variables = dict(group_vars.get("all") or {})
        for group in platform.get("groups", []):
            groups.setdefault(group, []).append(platform["name"])
            variables.update(group_vars.get(group) or {})
        variables.update(host_vars.get(platform["name"]) or {})
        hostvars[platform["name"]] = {k: v for k, v in variables.items() if "{{" not in str(v)}
    return groups, hostvars


SCENARIOS_WITH_PREFLIGHT = sorted(path.parent / "molecule.yml" for path in (REPO / "molecule").glob("*/converge.yml")
                                  if "playbooks/preflight.yml" in path.read_text())


@pytest.mark.parametrize("path", SCENARIOS_WITH_PREFLIGHT, ids=lambda path: path.parent.name)
def test_molecule_scenarios_that_run_preflight_pass_its_inventory_check(path):
    groups, hostvars = _molecule_inventory(path)
    assert pf.inventory_problems(groups, hostvars, RULES) == []


def test_a_scenario_runs_preflight():
    assert SCENARIOS_WITH_PREFLIGHT, "no molecule scenario imports preflight.yml: the test above checks nothing"


# -- the AWS file system backends (pulumi/aws's inventory) --------------------------------------------------------
FSX = {"dns_name": "fs-0123.fsx.us-east-1.amazonaws.com", "mount_name": "abcdefgh"}
CLOUD_GROUPS = {"all": ["n1"], "head": ["n1"], "gpu_nodes": ["n1"], "storage_nodes": [], "ungrouped": []}


def cloud_problems(groups=None, **changes):
    variables = {**GOOD_VARS, "cluster_storage_backend": "fsx_lustre", "cluster_shared_filesystem": FSX, **changes}
    return pf.inventory_problems(groups or CLOUD_GROUPS, {"n1": {k: v for k, v in variables.items() if v is not None}},
                                 RULES)


def test_cloud_backends_need_no_storage_nodes():
    assert cloud_problems() == []
    assert cloud_problems(cluster_storage_backend="efs", cluster_shared_filesystem={"dns_name": FSX["dns_name"]}) == []


@pytest.mark.parametrize(("changes", "message"), [
    ({"cluster_shared_filesystem": {"dns_name": FSX["dns_name"]}},
     "cluster_storage_backend is fsx_lustre but cluster_shared_filesystem has no mount_name"),
    ({"cluster_shared_filesystem": None}, "has no dns_name and no mount_name"),
    ({"cluster_storage_backend": "efs", "cluster_shared_filesystem": {"mount_name": "x"}},
     "cluster_storage_backend is efs but cluster_shared_filesystem has no dns_name"),
])
def test_cloud_backend_without_its_file_system_is_named(changes, message):
    problems = cloud_problems(**changes)
    assert any(message in problem for problem in problems), problems


def test_fsx_together_with_glusterfs_bricks_is_refused():
    problems = cloud_problems(groups=GROUPS)
    assert any("cluster_storage_backend is fsx_lustre but storage_nodes has n1: GlusterFS bricks and an AWS file "
               "system are two shared volumes" in problem for problem in problems), problems
