"""The host firewall's rules as data, and the nftables rule set made from them (roles/firewall).

The firewall role gathers what each node runs (its services, their ports read from the roles' own
variables, the inventory's node addresses, the admin networks, extra rules) into one plan; this module
checks the plan, stops with a message naming what is wrong before anything is applied, and renders one
nftables table that is loaded in one transaction. It is also what says whether an address may reach
a port (the check that applying never locks out the connection in use).
"""
import hashlib
import ipaddress
import re
import runpy
from pathlib import Path

from ansible.errors import AnsibleFilterError

# Filters cannot import module_utils or each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
values = _load("ansible/plugins/module_utils/values.py")
# Each value read as the playbooks read it (module_utils/values.py).
_int, _truthy = values.whole_number, values.ansible_bool

PROTOCOLS = ("tcp", "udp")
# Sources an extra rule may name instead of networks.
SOURCE_KEYWORDS = ("nodes", "admin", "any")
TABLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
UNSET = "__firewall_unset__"


class FirewallInputError(ValueError):
    """A problem of the firewall's input, worded for the person who wrote the inventory."""


def _text_range(item, where):
    if isinstance(item, str) and re.fullmatch(r"\s*[0-9]+\s*[-:]\s*[0-9]+\s*", item):
        first, last = re.split(r"[-:]", item)
        raise FirewallInputError(
            f"{where}: the port range '{item}' is text; write it as a list of two numbers, "
            f"[{first.strip()}, {last.strip()}]")


def _pair(first, last, where, item):
    if first is None or last is None:
        raise FirewallInputError(f"{where}: {item!r} is not a port; give a number from 1 to 65535 or a "
                                 "range as [first, last]")
    for port in (first, last):
        if not 1 <= port <= 65535:
            raise FirewallInputError(f"{where}: port {port} is outside 1-65535")
    if first > last:
        raise FirewallInputError(f"{where}: the range [{first}, {last}] ends before it starts; write "
                                 f"[{last}, {first}]")
    return (first, last)


def port_items(value, where):
    """Ports as given (one port, or a list whose items are ports and [first, last] ranges) as a list of
    (first, last) pairs. Text such as "8000-8100" is refused with the form to write instead."""
    pairs = []
    for item in value if isinstance(value, list) else [value]:
        _text_range(item, where)
        if isinstance(item, (list, tuple)):
            if len(item) != 2:
                raise FirewallInputError(f"{where}: {list(item)!r} is not a range; write [first, last]")
            pairs.append(_pair(_int(item[0]), _int(item[1]), where, item))
        else:
            pairs.append(_pair(_int(item), _int(item), where, item))
    return pairs


def port_range(value, where):
    """A [first, last] range (a role's *_port_range variable) as [(first, last)]."""
    _text_range(value, where)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise FirewallInputError(f"{where}: {value!r} is not a range; write [first, last], e.g. [49152, 60999]")
    return [_pair(_int(value[0]), _int(value[1]), where, value)]


def network(value, where):
    """value as an ip_network; a CIDR with host bits set, a bare address or any other text is refused."""
    text = str(value).strip()
    if "/" not in text:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            raise FirewallInputError(f"{where}: '{value}' is not a network; write one in CIDR form, e.g. "
                                     "192.0.2.0/24") from None
        raise FirewallInputError(f"{where}: '{value}' is an address, not a network; write "
                                 f"{address}/{address.max_prefixlen} for this one address")
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError:
        try:
            loose = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise FirewallInputError(f"{where}: '{value}' is not a network; write one in CIDR form, e.g. "
                                     "192.0.2.0/24") from None
        raise FirewallInputError(f"{where}: '{value}' has host bits set; the network is {loose}") from None


def networks_problems(values, name):
    """Problems of a list of networks (cluster_admin_cidrs), one line each; [] when all are networks."""
    if values is None:
        return []
    if not isinstance(values, list):
        return [f"{name} is {values!r}: give a list of networks in CIDR form, e.g. [192.0.2.0/24]"]
    problems = []
    for value in values:
        try:
            network(value, name)
        except FirewallInputError as err:
            problems.append(str(err))
    return problems


def _protocol(value, where):
    protocol = str(value if value is not None else "tcp").lower()
    if protocol not in PROTOCOLS:
        raise FirewallInputError(f"{where}: protocol '{value}' is not one of {', '.join(PROTOCOLS)}")
    return protocol


# ------------------------------------------------------------------------------------------ the services


def resolve_services(services, host, groups, role_defaults, role_values, local_port_range=None):
    """The services this host runs, each {name, protocol, ports: [(first, last)]}, with their ports read
    from the roles' variables.

    services: firewall_services (roles/firewall/defaults/main.yml): each {name, role, ports: [variable
    names] | port_range: variable name, protocol, group | group_var, enabled_var, enabled, count_var,
    ephemeral}. role_defaults: {role: that role's defaults/main.yml}; role_values: {variable: value set in
    the inventory or -e, or UNSET}. local_port_range: the node's ip_local_port_range as "first last"."""
    resolved = []

    def value_of(role, variable, where):
        given = role_values.get(variable, UNSET)
        if given != UNSET and given is not None:
            return given
        defaults = role_defaults.get(role) or {}
        if variable not in defaults:
            raise FirewallInputError(f"{where}: the {role} role has no variable {variable} in its "
                                     "defaults/main.yml")
        return defaults[variable]

    for index, service in enumerate(services or []):
        if not isinstance(service, dict) or not service.get("name"):
            raise FirewallInputError(f"firewall_services[{index}] is {service!r}: give a dict with at least "
                                     "name and ports")
        name = service["name"]
        where = f"firewall_services '{name}'"
        role = service.get("role")
        if "enabled" in service and not _truthy(service["enabled"]):
            continue
        if service.get("enabled_var"):
            switch = value_of(role, service["enabled_var"], where)
            wanted = service.get("enabled_value")
            if not (str(switch) == str(wanted) if wanted is not None else _truthy(switch)):
                continue
        group = service.get("group")
        if service.get("group_var"):
            group = value_of(role, service["group_var"], where)
        if group and host not in (groups.get(group) or []):
            continue
        protocol = _protocol(service.get("protocol"), where)
        ports = []
        if service.get("ephemeral"):
            if not local_port_range:
                raise FirewallInputError(f"{where}: the node's ip_local_port_range is unknown")
            first, last = str(local_port_range).split()
            ports.append((int(first), int(last)))
        for variable in service.get("ports") or []:
            value = value_of(role, variable, f"{where} ({variable})")
            pairs = port_items(value, f"{variable} ({role} role)")
            if service.get("count_var"):
                count = _int(value_of(role, service["count_var"], where))
                if count is None:
                    raise FirewallInputError(f"{where}: {service['count_var']} is not a whole number")
                pairs = [(first, last + max(count, 1) - 1) for first, last in pairs]
            ports += pairs
        if service.get("port_range"):
            variable = service["port_range"]
            ports += port_range(value_of(role, variable, where), f"{variable} ({role} role)")
        if not ports:
            raise FirewallInputError(f"{where}: no ports; name the role variables that hold them")
        resolved.append({"name": name, "protocol": protocol, "ports": ports})
    return resolved


# ------------------------------------------------------------------------------------------------ the plan


def _addresses(values, where):
    out = []
    for value in values or []:
        try:
            out.append(ipaddress.ip_address(str(value).strip()))
        except ValueError:
            raise FirewallInputError(f"{where}: '{value}' is not an IP address; give each node's cluster_address "
                                     "(or ansible_host) as an address") from None
    return sorted(set(out), key=lambda a: (a.version, int(a)))


def check_plan(plan):
    """The plan, checked and normalised: {table, ssh_port, admin: [networks], nodes: [addresses],
    services: [{name, protocol, ports}], extra: [{name, protocol, ports, sources}]}. Raises FirewallInputError."""
    table = str(plan.get("table") or "sd3_cluster_firewall")
    if not TABLE_NAME.match(table):
        raise FirewallInputError(f"firewall_table '{table}': use letters, digits and '_' (at most 32)")
    admin_given = plan.get("admin_cidrs") or []
    if not isinstance(admin_given, list):
        raise FirewallInputError(f"cluster_admin_cidrs is {admin_given!r}: give a list of networks, e.g. "
                                 "[192.0.2.0/24]")
    admin = [network(value, "cluster_admin_cidrs") for value in admin_given]
    nodes = _addresses(plan.get("node_addresses"), "the inventory's node addresses")
    if not nodes:
        raise FirewallInputError("the inventory gives no node addresses: the firewall would refuse every node")
    ssh = port_items(plan.get("ssh_port", 22), "firewall_ssh_port")
    services = []
    for service in plan.get("services") or []:
        where = f"service '{service.get('name')}'"
        services.append({"name": str(service["name"]), "protocol": _protocol(service.get("protocol"), where),
                         "ports": port_items([list(p) for p in service["ports"]], where)})
    extra = []
    known = {service["name"]: service for service in services}
    for index, rule in enumerate(plan.get("extra_rules") or []):
        if not isinstance(rule, dict):
            raise FirewallInputError(f"firewall_extra_rules[{index}] is {rule!r}: give a dict with name, "
                                     "sources and ports or services")
        name = str(rule.get("name") or f"extra rule {index + 1}")
        where = f"firewall_extra_rules '{name}'"
        unknown_keys = set(rule) - {"name", "protocol", "ports", "services", "sources"}
        if unknown_keys:
            raise FirewallInputError(f"{where}: unknown keys {', '.join(sorted(unknown_keys))}; use name, protocol, "
                                     "ports, services, sources")
        sources = rule.get("sources", "nodes")
        sources = sources if isinstance(sources, list) else [sources]
        checked_sources = []
        for source in sources:
            if str(source) in SOURCE_KEYWORDS:
                checked_sources.append(str(source))
            else:
                checked_sources.append(network(source, f"{where} sources"))
        if not checked_sources:
            raise FirewallInputError(f"{where}: no sources; name networks, or nodes, admin or any")
        if rule.get("ports") not in (None, []):
            extra.append({"name": name, "protocol": _protocol(rule.get("protocol"), where),
                          "ports": port_items(rule["ports"], where), "sources": checked_sources})
        for service_name in rule.get("services") or []:
            if service_name not in known:
                # A service this node does not run: nothing listens there, so nothing to open.
                if service_name not in (plan.get("service_names") or known):
                    raise FirewallInputError(f"{where}: no service '{service_name}' in firewall_services; known: "
                                             f"{', '.join(sorted(plan.get('service_names') or known))}")
                continue
            service = known[service_name]
            extra.append({"name": f"{name} ({service_name})", "protocol": service["protocol"],
                          "ports": service["ports"], "sources": checked_sources})
        if rule.get("ports") in (None, []) and not rule.get("services"):
            raise FirewallInputError(f"{where}: give ports (numbers or [first, last]) or services (names in "
                                     "firewall_services)")
    return {"table": table, "ssh": ssh, "admin": admin, "nodes": nodes, "services": services, "extra": extra}


# ----------------------------------------------------------------------------------------------- rendering


def _ports_text(pairs):
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in sorted(set(pairs))]
    return parts[0] if len(parts) == 1 else "{ " + ", ".join(parts) + " }"


def _elements(items):
    return ", ".join(str(item) for item in items)


def _source_matches(sources, plan):
    """nft match expressions (one per address family) for a rule's sources; [""] for any source."""
    if "any" in sources:
        return [""]
    matches = []
    for family, keyword in ((4, "ip"), (6, "ip6")):
        sets = []
        if "nodes" in sources and any(a.version == family for a in plan["nodes"]):
            sets.append(f"@nodes_v{family}")
        if "admin" in sources and any(n.version == family for n in plan["admin"]):
            sets.append(f"@admin_v{family}")
        for set_name in sets:
            matches.append(f"{keyword} saddr {set_name} ")
        networks = [s for s in sources if not isinstance(s, str) and s.version == family]
        if networks:
            matches.append(f"{keyword} saddr {{ {_elements(networks)} }} ")
    return matches


def render(plan):
    """The nftables script of the plan: creates the table if missing, deletes it, and defines it anew,
    all in the one transaction `nft -f` makes, so a node is never without rules halfway through."""
    plan = check_plan(plan)
    table = plan["table"]
    lines = [f"table inet {table}", f"delete table inet {table}", f"table inet {table} {{"]
    for family in (4, 6):
        nodes = [a for a in plan["nodes"] if a.version == family]
        admin = [n for n in plan["admin"] if n.version == family]
        for set_name, items, flags in ((f"nodes_v{family}", nodes, ""), (f"admin_v{family}", admin, "interval")):
            if not items:
                continue
            lines.append(f"\tset {set_name} {{")
            lines.append(f"\t\ttype ipv{family}_addr")
            if flags:
                lines.append(f"\t\tflags {flags}")
            lines.append(f"\t\telements = {{ {_elements(items)} }}")
            lines.append("\t}")
    lines += ["\tchain input {", "\t\ttype filter hook input priority filter; policy drop;",
              "\t\tct state established,related accept", "\t\tct state invalid drop", '\t\tiif "lo" accept',
              # ICMP and ICMPv6 by number: a minimal system has no /etc/protocols to resolve their names.
              "\t\tmeta l4proto { 1, 58 } accept"]

    def rule(name, protocol, ports, sources):
        comment = re.sub(r'["\\]', "'", name)[:120]
        for match in _source_matches(sources, plan):
            lines.append(f'\t\t{match}{protocol} dport {_ports_text(ports)} accept comment "{comment}"')

    rule("ssh", "tcp", plan["ssh"], ["admin", "nodes"])
    for service in plan["services"]:
        rule(service["name"], service["protocol"], service["ports"], ["nodes"])
    for extra in plan["extra"]:
        rule(extra["name"], extra["protocol"], extra["ports"], extra["sources"])
    lines += ["\t}", "}"]
    body = "\n".join(lines) + "\n"
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    # The digest in the table's comment tells the role whether the loaded rules are these (no diff of nft's output).
    body = body.replace(f"table inet {table} {{\n", f'table inet {table} {{\n\tcomment "sd3-cluster {digest}"\n', 1)
    return body


def ruleset_digest(text):
    """The digest render() put into the table's comment."""
    found = re.search(r'comment "sd3-cluster ([0-9a-f]{16})"', text or "")
    return found.group(1) if found else ""


def allows(plan, address, port, protocol="tcp"):
    """True when the plan accepts a new connection from address to port (the check before applying that the
    connection in use stays open)."""
    plan = check_plan(plan)
    source = ipaddress.ip_address(str(address).strip())
    port = int(port)

    def source_ok(sources):
        if "any" in sources:
            return True
        if "nodes" in sources and source in plan["nodes"]:
            return True
        if "admin" in sources and any(source in n for n in plan["admin"]):
            return True
        return any(source in s for s in sources if not isinstance(s, str))

    candidates = [("tcp", plan["ssh"], ["admin", "nodes"])]
    candidates += [(s["protocol"], s["ports"], ["nodes"]) for s in plan["services"]]
    candidates += [(e["protocol"], e["ports"], e["sources"]) for e in plan["extra"]]
    return any(proto == protocol and any(a <= port <= b for a, b in pairs) and source_ok(sources)
               for proto, pairs, sources in candidates)


# ------------------------------------------------------------------------------------------ Ansible glue


def _filter(function):
    def wrapped(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except FirewallInputError as err:
            raise AnsibleFilterError(f"firewall: {err}") from None
    wrapped.__name__ = function.__name__
    wrapped.__doc__ = function.__doc__
    return wrapped


class FilterModule:
    def filters(self):
        return {"firewall_host_services": _filter(resolve_services), "firewall_ruleset": _filter(render),
                "firewall_allows": _filter(allows), "firewall_ruleset_digest": ruleset_digest,
                "firewall_networks_problems": networks_problems}
