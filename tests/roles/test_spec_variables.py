"""Every variable a role or a day-2 playbook reads has the default its spec declares, or the spec requires it.

A lint of our own (spec_variables.py): it reads each role's tasks, handlers, defaults, vars and templates,
finds every read of a project variable (cluster_*, a role's prefix, a day-2 knob) and fails on a read that
would stop a run mid-way with "'x' is undefined" when the inventory leaves the variable out, and on a
`| default(V)` whose V is not the spec's default.
"""
from __future__ import annotations

import pytest
from spec_variables import REPO, Scope, expression_reads, load_yaml, role_scope, scan_tasks, spec_options, unsafe_reads

ROLES = sorted(path for path in (REPO / "roles").iterdir() if (path / "meta" / "argument_specs.yml").is_file())
DAY2_SPEC = REPO / "roles" / "day2" / "meta" / "argument_specs.yml"
DAY2_PREFIXES = {"day2"}
PREFIXES = {role.name for role in ROLES} | {"cluster"} | DAY2_PREFIXES


def test_every_role_has_an_argument_spec():
    assert {path.name for path in (REPO / "roles").iterdir() if path.is_dir()} == {role.name for role in ROLES}


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_role_reads_only_variables_with_a_value(role):
    scope = role_scope(role)
    assert scope.reads, f"{role.name}: no variable read found; the lint reads nothing"
    assert unsafe_reads(scope, spec_options(role / "meta" / "argument_specs.yml"), PREFIXES) == []


def test_day2_knobs_are_declared_by_the_day2_role():
    options = spec_options(DAY2_SPEC)
    for name in ("day2_scale_out_nodes", "day2_remove_nodes", "day2_remove_node_drain_timeout",
                 "day2_remove_node_brick_targets", "day2_remove_node_services", "day2_rolling_upgrade_hosts",
                 "day2_rolling_upgrade_batch", "day2_rolling_upgrade_reboot", "day2_rolling_upgrade_drain_timeout",
                 "day2_rolling_upgrade_reboot_timeout", "day2_marker_path", "day2_marker_groups"):
        assert name in options, f"roles/day2/meta/argument_specs.yml does not declare {name}"


@pytest.mark.parametrize("role", ["day2", "verify"])
def test_every_tasks_file_of_the_day2_and_verify_roles_is_an_entry_point(role):
    entries = set(load_yaml(REPO / "roles" / role / "meta" / "argument_specs.yml")["argument_specs"])
    assert entries == {path.stem for path in (REPO / "roles" / role / "tasks").glob("*.yml")}


def test_day2_and_verify_playbooks_read_knobs_with_their_spec_defaults():
    """The playbooks around the day2 and verify roles (hosts:, serial:, the knobs they pass on) read the
    roles' knobs with the defaults the roles' specs declare."""
    scope = Scope()
    playbooks = [REPO / "scale_out.yml", REPO / "remove_node.yml", REPO / "rolling_upgrade.yml",
                 REPO / "ansible" / "playbooks" / "verify.yml", REPO / "ansible" / "playbooks" / "converged.yml"]
    for path in playbooks:
        for play in load_yaml(path):
            scan_tasks([play], str(path.relative_to(REPO)), scope)
    assert any(read.name == "day2_rolling_upgrade_batch" for read in scope.reads)
    assert any(read.name == "verify_training" for read in scope.reads)
    options = spec_options(DAY2_SPEC) | spec_options(REPO / "roles" / "verify" / "meta" / "argument_specs.yml")
    assert unsafe_reads(scope, options, DAY2_PREFIXES | {"verify"}) == []


# The lint itself: each rule on a small example, so a lint that stopped seeing reads would fail here.
OPTIONS = {"demo_port": {"type": "int", "default": 80}, "demo_name": {"type": "str", "required": True},
           "cluster_mtu": {"type": "int", "default": 9000}}


def lint(tasks: list, sets: set[str] = frozenset()) -> list[str]:
    scope = Scope(sets=set(sets))
    scan_tasks(tasks, "tasks/main.yml", scope)
    return unsafe_reads(scope, OPTIONS, {"demo", "cluster"})


def test_lint_finds_a_read_without_a_default():
    problems = lint([{"name": "x", "ansible.builtin.debug": {"msg": "{{ cluster_mtu | int }}"}}])
    assert problems == ["tasks/main.yml: reads cluster_mtu unguarded: the spec's default 9000 is not in "
                        "defaults/main.yml"]


def test_lint_finds_an_undeclared_variable_in_a_condition():
    assert lint([{"name": "x", "ansible.builtin.debug": {}, "when": "demo_extra | bool"}]) == [
        "tasks/main.yml: reads demo_extra unguarded: no spec declares it required or gives it a default"]


def test_lint_finds_a_default_other_than_the_specs():
    assert lint([{"name": "x", "ansible.builtin.debug": {"msg": "{{ demo_port | default(8080) }}"}}]) == [
        "tasks/main.yml: reads demo_port | default(8080), but its spec declares default 80"]


@pytest.mark.parametrize("task", [
    {"name": "x", "ansible.builtin.debug": {"msg": "{{ demo_port | default(80) }}"}},
    {"name": "x", "ansible.builtin.debug": {"msg": "{{ demo_name }}"}},
    {"name": "x", "ansible.builtin.debug": {"msg": "{{ cluster_group.name | default('') }}"}},
    {"name": "x", "ansible.builtin.debug": {}, "when": ["demo_extra is defined", "demo_extra | bool"]},
    {"name": "x", "ansible.builtin.debug": {"msg": "{% set demo_local = 1 %}{{ demo_local }}"}},
    {"name": "x", "ansible.builtin.debug": {"msg": "{{ __demo_private }} {{ other_thing }}"}},
])
def test_lint_passes_safe_reads(task):
    assert lint([task]) == []


def test_lint_passes_what_the_role_sets():
    assert lint([{"name": "x", "ansible.builtin.set_fact": {"demo_seen": 1}},
                 {"name": "y", "ansible.builtin.debug": {"msg": "{{ demo_seen }}"}}]) == []
    assert lint([{"name": "x", "ansible.builtin.debug": {"msg": "{{ demo_port }}"}}], sets={"demo_port"}) == []


def test_templates_are_read_too():
    reads = expression_reads("{% if cluster_mtu > 1500 %}jumbo{% endif %}", "templates/x.j2")
    assert [(read.name, read.guarded) for read in reads] == [("cluster_mtu", False)]
