"""Which of the project's variables the roles and the day-2 playbooks read, and whether each read is safe.

A read is safe when the variable has a value whatever the inventory says: the role's defaults or vars set it,
the role sets it itself (set_fact, register, vars:, loop_var), its spec requires it (a missing one stops at the
role's start), or the read carries a default (`x | default(...)`, or an `x is defined` test in the same
expression). A spec that declares a default promises that value: a role that reads the variable unguarded and
without a defaults entry fails with "'x' is undefined" mid-run instead. Used by test_spec_variables.py.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import yaml
from jinja2 import meta, nodes

REPO = Path(__file__).resolve().parents[2]
CONDITION_KEYS = {"when", "that", "failed_when", "changed_when", "until"}
SET_FACT_ACTIONS = {"set_fact", "ansible.builtin.set_fact"}
INCLUDE_ROLE_ACTIONS = {"include_role", "import_role", "ansible.builtin.include_role", "ansible.builtin.import_role"}


class _AnyName(dict):
    """Ansible's filters and tests are known to Ansible, not to plain Jinja: every name passes here."""

    def __contains__(self, name):
        return True

    def get(self, name, default=None):
        return super().get(name) or (lambda *args, **kwargs: None)


ENV = jinja2.Environment(extensions=["jinja2.ext.do", "jinja2.ext.loopcontrols"])
ENV.filters, ENV.tests = _AnyName(ENV.filters), _AnyName(ENV.tests)


@dataclass
class Read:
    name: str
    guarded: bool
    default: object = None  # the constant of `| default(CONST)`, when there is one
    has_default_const: bool = False
    where: str = ""


@dataclass
class Scope:
    """What a role (or the day-2 playbooks) reads and sets."""
    reads: list[Read] = field(default_factory=list)
    sets: set[str] = field(default_factory=set)


class _Loader(yaml.SafeLoader):
    pass


# Ansible's tags (!unsafe, !vault) read as plain strings here.
_Loader.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node)
                              if isinstance(node, yaml.ScalarNode) else None)


def load_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader subclass


def expression_reads(source: str, where: str, condition: bool = False) -> list[Read]:
    """Every free variable an expression or template reads, each marked guarded or not."""
    text = "{{ (" + source + ") }}" if condition else source
    try:
        with warnings.catch_warnings():  # regex escapes inside Ansible's strings are not Jinja's concern here
            warnings.simplefilter("ignore", DeprecationWarning)
            tree = ENV.parse(text)
    except jinja2.TemplateSyntaxError:
        return []  # Ansible's own syntax (e.g. lookup plugins with odd quoting) is lint's business, not ours
    free = meta.find_undeclared_variables(tree)
    tested = {test.node.name for test in tree.find_all(nodes.Test)
              if test.name in ("defined", "undefined") and isinstance(test.node, nodes.Name)}
    reads: list[Read] = []

    def walk(node):
        if isinstance(node, nodes.Filter) and node.name == "default":
            # `x.a.b | default(...)` is safe too: an undefined x gives an undefined x.a.b, which default replaces.
            base = node.node
            while isinstance(base, (nodes.Getattr, nodes.Getitem)):
                if isinstance(base, nodes.Getitem):
                    walk(base.arg)
                base = base.node
            if isinstance(base, nodes.Name):
                const = node.args[0] if node.args and isinstance(node.args[0], nodes.Const) else None
                exact = base is node.node and const is not None  # the default stands for x itself
                reads.append(Read(base.name, True, const.value if exact else None, exact, where))
            else:
                walk(node.node)
            for child in list(node.args) + [kw.value for kw in node.kwargs]:
                walk(child)
            return
        if isinstance(node, nodes.Name) and node.ctx == "load" and node.name in free:
            reads.append(Read(node.name, node.name in tested, where=where))
            return
        for child in node.iter_child_nodes():
            walk(child)

    walk(tree)
    return reads


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def scan_tasks(data, where: str, scope: Scope) -> None:
    """Reads and sets of a task list (tasks/, handlers/, a playbook's plays)."""
    if isinstance(data, list):
        for item in data:
            scan_tasks(item, where, scope)
        return
    if not isinstance(data, dict):
        return
    for key in ("vars",):
        if isinstance(data.get(key), dict):
            scope.sets.update(data[key])
    if isinstance(data.get("register"), str):
        scope.sets.add(data["register"])
    loop_var = (data.get("loop_control") or {}).get("loop_var") if isinstance(data.get("loop_control"), dict) else None
    if loop_var:
        scope.sets.add(loop_var)
    for action in SET_FACT_ACTIONS:
        if isinstance(data.get(action), dict):
            scope.sets.update(k for k in data[action] if k != "cacheable")
    for action in INCLUDE_ROLE_ACTIONS:
        if isinstance(data.get(action), dict) and isinstance(data[action].get("name"), str):
            scope.sets.update(role_facts(REPO / "roles" / data[action]["name"]))
    conditions = []
    for key, value in data.items():
        if key in ("block", "rescue", "always", "tasks", "handlers", "pre_tasks", "post_tasks"):
            scan_tasks(value, where, scope)
        elif key in CONDITION_KEYS:
            items = value if isinstance(value, list) else [value]
            conditions += [str(item) for item in items if not isinstance(item, bool)]
        else:
            for text in _strings(value):
                if "{{" in text or "{%" in text:
                    scope.reads += expression_reads(text, where)
    if conditions:
        # One expression, as Ansible ANDs them: an `is defined` test guards the items after it.
        scope.reads += expression_reads(" ) and ( ".join(conditions), where, condition=True)


def role_facts(role: Path) -> set[str]:
    """The facts a role sets (set_fact, register): they outlive its include_role, so its caller may read them."""
    facts: set[str] = set()

    def walk(data):
        if isinstance(data, list):
            for item in data:
                walk(item)
        elif isinstance(data, dict):
            if isinstance(data.get("register"), str):
                facts.add(data["register"])
            for action in SET_FACT_ACTIONS:
                if isinstance(data.get(action), dict):
                    facts.update(k for k in data[action] if k != "cacheable")
            for key in ("block", "rescue", "always"):
                walk(data.get(key))

    for path in sorted((role / "tasks").glob("*.yml")):
        walk(load_yaml(path))
    return facts


def role_scope(role: Path) -> Scope:
    scope = Scope()
    for folder in ("tasks", "handlers"):
        for path in sorted((role / folder).glob("*.yml")):
            scan_tasks(load_yaml(path), str(path.relative_to(REPO)), scope)
    for folder in ("defaults", "vars"):
        for path in sorted((role / folder).glob("*.yml")):
            data = load_yaml(path) or {}
            scope.sets.update(data)
            for text in _strings(data):
                if "{{" in text or "{%" in text:
                    scope.reads += expression_reads(text, str(path.relative_to(REPO)))
    for path in sorted((role / "templates").rglob("*.j2")):
        scope.reads += expression_reads(path.read_text(), str(path.relative_to(REPO)))
    # What a dependency sets (cluster: the cluster_* variables, cluster_node_address) is set
    # wherever the role runs: the dependency runs first.
    meta = role / "meta" / "main.yml"
    for dependency in ((load_yaml(meta) or {}).get("dependencies") or []) if meta.is_file() else []:
        name = dependency if isinstance(dependency, str) else dependency.get("role") or dependency.get("name")
        scope.sets.update(role_scope(REPO / "roles" / name).sets)
    return scope


def spec_options(path: Path) -> dict:
    options: dict = {}
    for entry in (load_yaml(path).get("argument_specs") or {}).values():
        options.update((entry or {}).get("options") or {})
    return options


def unsafe_reads(scope: Scope, options: dict, prefixes: set[str]) -> list[str]:
    """Reads of our variables (a known prefix) that can fail with 'is undefined', and guarded reads whose
    default is not the one the spec declares."""
    problems = []
    required = {name for name, option in options.items() if (option or {}).get("required")}
    for read in scope.reads:
        if read.name.startswith("_") or not any(read.name.startswith(prefix + "_") for prefix in prefixes):
            continue
        if not read.guarded and read.name not in scope.sets and read.name not in required:
            declared = options.get(read.name) or {}
            hint = (f"the spec's default {declared['default']!r} is not in defaults/main.yml" if "default" in declared
                    else "no spec declares it required or gives it a default")
            problems.append(f"{read.where}: reads {read.name} unguarded: {hint}")
        elif read.has_default_const and "default" in (options.get(read.name) or {}):
            spec_default = options[read.name]["default"]
            if read.default != spec_default and str(read.default) != str(spec_default):
                problems.append(f"{read.where}: reads {read.name} | default({read.default!r}), but its spec "
                                f"declares default {spec_default!r}")
    return sorted(set(problems))
