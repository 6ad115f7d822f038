"""Preflight's rules, as Jinja filters: the inventory as a whole, then each node and its network.

The preflight role (roles/preflight/tasks/inventory.yml) and the day-2 playbooks' first play
(roles/day2/tasks/inputs.yml) call the inventory rules before any node is changed; the role's node and
network checks (tasks/node.yml, tasks/network.yml) hold each node's probe and pings to its thresholds. Each
returns a list of problems, one sentence each, naming the host, the variable and the fix; an empty list means
the inventory, the node or the network may go on.
The roles' own checks (meta/argument_specs.yml, tasks/validate.yml) stay as a second line.

The variables this project knows are read from the roles' meta/argument_specs.yml files (the day-2
playbooks' knobs from roles/day2's): a name that looks like ours but that no spec declares is a typo until a
spec declares it.
"""

from __future__ import annotations

import difflib
import glob
import ipaddress
import posixpath
import re
import runpy
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.common.validation import check_type_bool, check_type_float, check_type_int

# Filters cannot import module_utils or each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
values = _load("ansible/plugins/module_utils/values.py")
# Each value read as the playbooks read it (module_utils/values.py).
_int = values.whole_number

# Login and group names that useradd accepts everywhere (Debian's NAME_REGEX, at most 32 characters).
POSIX_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# A cluster name goes into host-like places (Slurm's ClusterName, labels, file names): one DNS label.
HOSTNAME_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
# A name this close to a known one (difflib's ratio) is taken as a typo of it even without our prefix.
CLOSE_MATCH_CUTOFF = 0.85
# The hint "did you mean" accepts a looser match once the name has our prefix.
HINT_CUTOFF = 0.6


# ---------------------------------------------------------------------------------------------- known names


def spec_paths(spec_files):
    """The spec files, each a path or a glob (roles/*/meta/argument_specs.yml), in a stable order."""
    paths = []
    for pattern in spec_files:
        if glob.has_magic(str(pattern)):
            paths += sorted(Path(match) for match in glob.glob(str(pattern)))
        elif Path(pattern).is_file():
            paths.append(Path(pattern))
    return paths


def read_specs(spec_files):
    """{entry point: {option: spec}} merged over meta/argument_specs.yml-shaped files, in order."""
    entries = {}
    for path in spec_paths(spec_files):
        data = yaml.safe_load(Path(path).read_text()) or {}
        for entry, spec in (data.get("argument_specs") or {}).items():
            entries.setdefault(entry, {}).update((spec or {}).get("options") or {})
    return entries


def known_variables(spec_files):
    """{'names': every option a spec declares, 'prefixes': the prefixes of our variables}.

    A spec file is either a role's meta/argument_specs.yml (its role's name, the folder above meta, is a
    prefix) or a playbook spec whose entry points are the prefixes (scale_out, remove_node, ...)."""
    names, prefixes = set(), {"cluster"}
    for path in spec_paths(spec_files):
        entries = read_specs([path])
        for options in entries.values():
            names.update(options)
        if path.parent.name == "meta":
            prefixes.add(path.parent.parent.name)
        else:
            prefixes.update(entries)
    return {"names": sorted(names), "prefixes": sorted(prefixes)}


def closest_known(name, known, cutoff=HINT_CUTOFF):
    """The known name closest to name (difflib), or None."""
    matches = difflib.get_close_matches(name, known["names"], n=1, cutoff=cutoff)
    return matches[0] if matches else None


def unknown_variable_problems(names, known):
    """One problem per name that looks like ours (our prefix, or very close to a known name) but that no spec
    declares; private names (a leading underscore) are the roles' own."""
    declared = set(known["names"])
    problems = []
    for name in sorted(set(names)):
        if name in declared or name.startswith("_"):
            continue
        ours = any(name.startswith(prefix + "_") for prefix in known["prefixes"])
        # A name that holds a whole known one (pulumi_cluster_name, from the cloud inventory) is another tool's
        # copy of it, not a typo.
        foreign_copy = any(known_name in name for known_name in declared)
        close = None if foreign_copy else closest_known(name, known, CLOSE_MATCH_CUTOFF)
        if not ours and not close:
            continue
        hint = close or closest_known(name, known)
        problems.append(
            f"{name} is not a variable of this project (no role's meta/argument_specs.yml declares it)"
            + (f": did you mean {hint}?" if hint else ": remove it, or check the roles' README for the right name"))
    return problems


def spec_value_problems(variables, spec_entries):
    """Problems of the values set (types, choices, list elements, sub-options) against every spec that declares
    them: the check each role makes when it starts, made here before the first layer changes a node.

    variables: {name: value} as set in the inventory or with -e; spec_entries: {spec label: {option: spec}}.
    cluster_* values are left to cluster_variable_problems, whose messages say more; a missing required
    option is the role's business (a role may not run on this host)."""
    problems = []
    for label, options in spec_entries.items():
        present = {name: dict(option or {}, required=False) for name, option in options.items()
                   if name in variables and not name.startswith("cluster_")}
        if not present:
            continue
        result = ArgumentSpecValidator(present).validate({name: variables[name] for name in present})
        problems += [f"{message} ({label})" for message in result.error_messages]
    return problems


def spec_entries(spec_files):
    """{'roles/ROLE/meta/argument_specs.yml ENTRY' or the file's path: options} for every spec file."""
    entries = {}
    for path in spec_paths(spec_files):
        label = f"roles/{path.parent.parent.name}/meta/argument_specs.yml" if path.parent.name == "meta" else path.name
        for entry, options in read_specs([path]).items():
            entries[f"{label}, {entry}"] = options
    return entries


# ------------------------------------------------------------------------------------ cluster-wide settings


def _missing(value):
    return value is None or (isinstance(value, str) and value.strip() == "")


def _id_problem(what, value, id_range):
    low, high = id_range
    number = _int(value)
    if number is None:
        return f"{what} is {value!r}, not a whole number: give a fixed id from {low} to {high}"
    if not low <= number <= high:
        return (f"{what} is {number}: use an id from {low} to {high} (lower ids belong to the system and root, "
                "higher ones are reserved by Debian and Ubuntu; preflight_id_range sets the range)")
    return None


def group_problems(group, id_range):
    """cluster_group: a mapping {name, gid} with a POSIX name and a gid in range."""
    if not isinstance(group, Mapping):
        return [f"cluster_group is {_kind(group)} ({group!r}): it must be a mapping such as "
                "{name: sd3, gid: 2000}"]
    problems = []
    name = group.get("name")
    if _missing(name) or not POSIX_NAME.match(str(name)):
        problems.append(f"cluster_group.name is {name!r}: use a group name of lower-case letters, digits, '_' or '-' "
                        "(no spaces), starting with a letter, at most 32 characters")
    problem = _id_problem("cluster_group.gid", group.get("gid"), id_range)
    if problem:
        problems.append(problem)
    for key in sorted(set(group) - {"name", "gid"}):
        problems.append(f"cluster_group has an unknown key {key!r}: only name and gid are read")
    return problems


USER_KEYS = {"name", "uid", "admin", "docker"}


def users_problems(users, group, id_range):
    """cluster_users: a list of {name, uid, admin, docker}, names and uids unique, uids in range."""
    if isinstance(users, (str, Mapping)) or not isinstance(users, Sequence):
        return [f"cluster_users is {_kind(users)}, not a list: write one item per user, "
                "e.g. '- {name: trainer, uid: 2001}' (a mapping of users is not read)"]
    problems, names, uids = [], {}, {}
    for index, user in enumerate(users):
        where = f"cluster_users[{index}]"
        if not isinstance(user, Mapping):
            problems.append(f"{where} is {user!r}: each user is a mapping {{name, uid, admin, docker}}")
            continue
        name = user.get("name")
        if not _missing(name):
            where = f"{where} ({name})"
        if _missing(name) or not POSIX_NAME.match(str(name)):
            problems.append(f"{where}: name {name!r} is not a valid login name: use lower-case letters, digits, '_' "
                            "or '-' (no spaces), starting with a letter, at most 32 characters")
        elif name in names:
            problems.append(f"{where}: name {name} is also cluster_users[{names[name]}]: every user once")
        else:
            names[name] = index
        problem = _id_problem(f"{where}: uid", user.get("uid"), id_range)
        if problem:
            problems.append(problem)
        else:
            uid = _int(user.get("uid"))
            if uid in uids:
                problems.append(f"{where}: uid {uid} is also the uid of {uids[uid]}: every user needs their own uid "
                                "(files on the shared volume belong to numbers, not names)")
            else:
                uids[uid] = name
        for flag in ("admin", "docker"):
            if flag in user and not isinstance(user[flag], bool):
                problems.append(f"{where}: {flag} is {user[flag]!r}: write true or false")
        for key in sorted(set(user) - USER_KEYS):
            hint = difflib.get_close_matches(key, sorted(USER_KEYS), n=1)
            problems.append(f"{where}: unknown key {key!r}" + (f": did you mean {hint[0]}?" if hint else
                                                                f": a user has only {', '.join(sorted(USER_KEYS))}"))
    return problems


def path_problems(name, value):
    """An absolute, normalised path that is not / itself."""
    if _missing(value) or not isinstance(value, str):
        return [f"{name} is {value!r}: give an absolute path such as /shared"]
    if not value.startswith("/"):
        return [f"{name} is '{value}', a relative path: give an absolute path such as /{value.lstrip('./')}"]
    if posixpath.normpath(value) == "/":
        return [f"{name} is '/': the shared volume needs a folder of its own, such as /shared"]
    if posixpath.normpath(value) != value.rstrip("/") or " " in value:
        return [f"{name} is '{value}': write it plainly, without '..', '//' or spaces, e.g. "
                f"{posixpath.normpath(value).replace(' ', '_')}"]
    return []


def count_problems(name, value, minimum, default):
    """A whole number of at least minimum; None (unset) takes the spec's default."""
    if value is None:
        value = default
    number = _int(value)
    if number is None:
        return [f"{name} is {value!r}, not a whole number: give a number of {minimum} or more"]
    if number < minimum:
        return [f"{name} is {number}: it must be {minimum} or more"]
    return []


def cluster_variable_problems(variables, rules):
    """Problems of one host's cluster_* settings (each check reads one variable and names it)."""
    get = variables.get
    problems = []
    name = get("cluster_name")
    if _missing(name):
        problems.append("cluster_name is not set: name the cluster in group_vars/all, e.g. cluster_name: sd3-prod")
    elif not HOSTNAME_LABEL.match(str(name)):
        problems.append(f"cluster_name is '{name}': use letters, digits and '-' only (no spaces, at most 63), "
                        f"e.g. {re.sub(r'[^A-Za-z0-9-]+', '-', str(name)).strip('-') or 'sd3-prod'}; it names the "
                        "Slurm cluster, labels and files")
    network = get("cluster_network_cidr")
    if not _is_network(network):
        problems.append(f"cluster_network_cidr is '{network if network is not None else 'undefined'}', not a network: "
                        "set it in group_vars/all, e.g. 10.10.0.0/24")
    backend = get("cluster_storage_backend")
    if backend not in rules["storage_backends"]:
        problems.append(f"cluster_storage_backend is '{backend}': choose one of {', '.join(rules['storage_backends'])}")
    mtu = get("cluster_mtu", 9000)
    low, high = rules["mtu_range"]
    if _int(mtu) is None or not low <= _int(mtu) <= high:
        problems.append(f"cluster_mtu is {mtu}: use a value from {low} to {high} (1500 for plain Ethernet, "
                        "9000 for jumbo frames)")
    problems += count_problems("cluster_storage_replica", get("cluster_storage_replica"), 1, 3)
    problems += count_problems("cluster_storage_bricks_per_node", get("cluster_storage_bricks_per_node"), 1, 1)
    problems += count_problems("cluster_gpus_per_node", get("cluster_gpus_per_node"), 0, 0)
    if get("cluster_shared_path") is not None:
        problems += path_problems("cluster_shared_path", get("cluster_shared_path"))
    flag = get("cluster_nodes_are_containers", False)
    if not isinstance(flag, bool):
        problems.append(f"cluster_nodes_are_containers is {flag!r}: write true or false")
    if get("cluster_group") is not None:
        problems += group_problems(get("cluster_group"), rules["id_range"])
    if get("cluster_users") is not None:
        problems += users_problems(get("cluster_users"), get("cluster_group"), rules["id_range"])
    problems += admin_cidrs_problems(get("cluster_admin_cidrs"))
    return problems


def _topology():
    """The storage topology rules (module_utils/topology.py): one copy of the replica-set rule."""
    return _load("ansible/plugins/module_utils/topology.py")


def _firewall_rules():
    """The firewall role's rules (firewall.py beside this file): one reading of what a network is."""
    return _load("ansible/plugins/filter/firewall.py")


def admin_cidrs_problems(value):
    """Problems of cluster_admin_cidrs: a list of networks in CIDR form (the firewall opens SSH to them)."""
    return _firewall_rules().networks_problems(value, "cluster_admin_cidrs")


# ------------------------------------------------------------------------------------------ the inventory


def _is_network(value):
    try:
        ipaddress.ip_network(str(value), strict=True)
    except ValueError:
        return False
    return value is not None and "/" in str(value)


def _is_address(value):
    try:
        ipaddress.ip_address(str(value))
    except ValueError:
        return False
    return True


# Variables that exist only inside a play (Ansible's magic variables and facts). hostvars templates a host's value
# without them, so a value built from them (the local inventory's backup_sftp_host reads
# hostvars[backup_sftp_server]) cannot be read here; it is checked where a play uses it, not reported as broken.
_PLAY_ONLY_UNDEFINED = re.compile(r"'(hostvars|groups|group_names|inventory_hostname(_short)?|inventory_dir|"
                                  r"inventory_file|play_hosts|ansible_play_\w+|ansible_facts|ansible_\w+|omit)' "
                                  r"is undefined")


def _host_variables(hostvars, host, names):
    """The host's variables, read one at a time: a value that cannot be templated becomes a problem, not a
    traceback."""
    variables, problems = {}, []
    for name in names:
        try:
            value = hostvars[host][name]
        except KeyError:
            continue
        except Exception as error:  # any templating error is the user's to fix, named
            reason = str(error)
        else:
            if not isinstance(value, jinja2.Undefined):
                variables[name] = value
                continue
            reason = _undefined_reason(value)  # Ansible 2.19 hands an undefined value on instead of raising
        if not _PLAY_ONLY_UNDEFINED.search(reason):
            problems.append(f"{name} cannot be read ({reason}): fix its value in the inventory")
    return variables, problems


def _undefined_reason(value):
    try:
        return str(value._undefined_message)
    except Exception as error:  # the message itself is what failed to render
        return str(error)


def _kind(value):
    """A user's word for a YAML value's type."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Sequence):
        return "a list"
    return type(value).__name__


def _by_hosts(per_host, all_hosts):
    """Problems found on several hosts once: bare when every host has it, else with the hosts named."""
    seen = {}
    for host in sorted(per_host):
        for problem in per_host[host]:
            seen.setdefault(problem, []).append(host)
    out = []
    for problem, hosts in seen.items():
        if len(hosts) == len(all_hosts):
            out.append(problem)
        else:
            out.append(f"host {', '.join(hosts)}: {problem}")
    return out


# Backends whose volume lives outside the storage_nodes (the head's NFS export, an AWS file system), and the
# keys of cluster_shared_filesystem that the cloud ones need (what pulumi/aws exports for each).
BRICKLESS_BACKENDS = ("nfs", "fsx_lustre", "efs")
CLOUD_FILESYSTEM_KEYS = {"fsx_lustre": ("dns_name", "mount_name"), "efs": ("dns_name",)}


def group_layout_problems(groups, backend, rules):
    problems = []
    for group in rules["required_groups"]:
        if group not in groups:
            problems.append(f"group '{group}' is missing: declare it in the inventory (hosts.yml), "
                            "see inventories/prod/hosts.yml")
        elif not groups[group] and not (group == "storage_nodes" and backend in BRICKLESS_BACKENDS):
            problems.append(f"group '{group}' has no hosts: put at least one node in it")
    heads = groups.get("head") or []
    if len(heads) > 1:
        problems.append(f"group 'head' has {len(heads)} hosts ({', '.join(heads)}): a cluster has exactly one head; "
                        "keep one and move the others to gpu_nodes")
    return problems


def address_problems(groups, hostvars, network):
    problems, seen_addresses, seen_names = [], {}, {}
    for host in sorted(groups.get("all") or []):
        variables = hostvars[host]
        address = next((str(variables.get(key)) for key in ("cluster_address", "ansible_host")
                        if variables.get(key) not in (None, "")), str(host))
        short = host.split(".")[0]
        if short in seen_names:
            problems.append(f"host {host}: short name '{short}' is also used by {seen_names[short]}; nodes are "
                            "found by short name in /etc/hosts, so rename one")
        else:
            seen_names[short] = host
        if not HOSTNAME_LABEL.match(short):
            problems.append(f"host {host}: '{short}' is not a valid host name (letters, digits and '-'): Slurm and "
                            "/etc/hosts need one, so rename it in the inventory")
        if not _is_address(address):
            problems.append(f"host {host}: address '{address}' is not an IP address: set ansible_host (or "
                            "cluster_address) to the node's address on the cluster network")
            continue
        if address in seen_addresses:
            problems.append(f"host {host}: address {address} is also used by {seen_addresses[address]}: every node "
                            "needs its own address")
        else:
            seen_addresses[address] = host
        if _is_network(network) and ipaddress.ip_address(address) not in ipaddress.ip_network(network):
            problems.append(f"host {host}: address {address} is outside cluster_network_cidr {network}: fix the "
                            "address or the CIDR")
    return problems


def storage_layout_problems(groups, variables):
    if variables.get("cluster_storage_backend") != "glusterfs" or "storage_nodes" not in groups:
        return []
    replica = _int(variables.get("cluster_storage_replica", 3))
    per_node = _int(variables.get("cluster_storage_bricks_per_node", 1))
    if replica is None or per_node is None or replica < 1 or per_node < 1:
        return []  # said by cluster_variable_problems
    count = len(groups["storage_nodes"])
    if replica > count:
        return [f"cluster_storage_replica is {replica} but storage_nodes has only {count} host(s): add storage nodes "
                "or lower cluster_storage_replica"]
    if not _topology().whole_replica_sets(count * per_node, replica):
        return [f"{count * per_node} bricks ({count} storage_nodes x cluster_storage_bricks_per_node {per_node}) is "
                f"not a multiple of cluster_storage_replica {replica}: add or remove storage nodes, or change the "
                "replica count"]
    return []


def shared_filesystem_problems(groups, variables):
    """A cloud backend (fsx_lustre, efs) needs the file system's names, and no GlusterFS bricks beside it."""
    backend = variables.get("cluster_storage_backend")
    if backend not in CLOUD_FILESYSTEM_KEYS:
        return []
    problems = []
    filesystem = variables.get("cluster_shared_filesystem")
    if not isinstance(filesystem, Mapping):
        filesystem = {}
    missing = [key for key in CLOUD_FILESYSTEM_KEYS[backend] if not str(filesystem.get(key) or "").strip()]
    if missing:
        what = "FSx for Lustre" if backend == "fsx_lustre" else "EFS"
        problems.append(f"cluster_storage_backend is {backend} but cluster_shared_filesystem has no "
                        f"{' and no '.join(missing)}: give the {what} file system's "
                        f"{', '.join(CLOUD_FILESYSTEM_KEYS[backend])} (pulumi/aws sets them; by hand: "
                        "`aws fsx describe-file-systems` or `aws efs describe-file-systems`)")
    bricks = groups.get("storage_nodes") or []
    if bricks:
        problems.append(f"cluster_storage_backend is {backend} but storage_nodes has {', '.join(sorted(bricks))}: "
                        "GlusterFS bricks and an AWS file system are two shared volumes at one path; empty "
                        "storage_nodes, or choose cluster_storage_backend glusterfs")
    return problems


def inventory_problems(groups, hostvars, rules):
    """Every problem of the inventory as a whole: the groups, every host's address and name, every cluster_*
    setting, the storage layout, and every variable that looks like ours but that no spec declares.

    groups, hostvars: Ansible's magic variables. rules: {storage_backends, mtu_range, required_groups,
    id_range, spec_files} (roles/preflight/vars/main.yml)."""
    hosts = sorted(groups.get("all") or [])
    if not hosts:
        return ["the inventory has no hosts: check the -i path and that hosts.yml lists the nodes under all, "
                "head, gpu_nodes and storage_nodes"]
    known = known_variables(rules["spec_files"])
    if not known["names"]:
        return [f"no argument specs were found at {', '.join(map(str, rules['spec_files']))}: run from a checkout "
                "of this project, whose roles each have meta/argument_specs.yml"]
    entries = spec_entries(rules["spec_files"])
    declared = set(known["names"])
    first = {}
    per_host_cluster, per_host_unknown, per_host_spec = {}, {}, {}
    for host in hosts:
        names = list(hostvars[host].keys())
        ours = [name for name in names if name.startswith("cluster_") or name in declared]
        variables, problems = _host_variables(hostvars, host, ours)
        cluster = {name: value for name, value in variables.items() if name.startswith("cluster_")}
        per_host_cluster[host] = problems + cluster_variable_problems(cluster, rules)
        per_host_unknown[host] = unknown_variable_problems(names, known)
        per_host_spec[host] = spec_value_problems(variables, entries)
        first = first or cluster
    problems = group_layout_problems(groups, first.get("cluster_storage_backend"), rules)
    problems += _by_hosts(per_host_unknown, hosts)
    problems += _by_hosts(per_host_cluster, hosts)
    problems += _by_hosts(per_host_spec, hosts)
    problems += address_problems(groups, hostvars, first.get("cluster_network_cidr"))
    problems += storage_layout_problems(groups, first)
    problems += shared_filesystem_problems(groups, first)
    return problems


# --------------------------------------------------------------------------------- one node and its network


def node_problems(node, host, groups, settings):
    """One problem per threshold this node misses, each naming the variable and the fix.

    node: the output of the role's probe_node.py (cpu_cores, memory_gb, disk_path, disk_free_gb, disk_device,
    disk_rotational, nvidia_gpus). settings: the role's thresholds without their preflight_ prefix (min_cpu_cores,
    min_memory_gb, data_path, min_free_disk_gb, require_ssd, require_gpus, min_gpus_per_node) and gpus_per_node,
    the inventory's cluster_gpus_per_node for this host. A threshold is read as its argument spec reads it
    (text from -e included); the spec has refused one that is not a number before these rules run."""
    problems = []
    min_cores = settings["min_cpu_cores"]
    if node["cpu_cores"] < check_type_int(min_cores):
        problems.append(f"{node['cpu_cores']} CPU cores, needs at least {min_cores} (preflight_min_cpu_cores): use a "
                        "larger machine or lower the threshold in group_vars")
    min_memory = settings["min_memory_gb"]
    if node["memory_gb"] < check_type_float(min_memory):
        problems.append(f"{float(node['memory_gb']):.1f} GB of memory, needs at least {min_memory} "
                        "(preflight_min_memory_gb): add memory or lower the threshold")
    min_disk, data_path = settings["min_free_disk_gb"], settings["data_path"]
    if node["disk_free_gb"] < check_type_float(min_disk):
        problems.append(f"{float(node['disk_free_gb']):.1f} GB free under {data_path} (checked at "
                        f"{node['disk_path']}), needs at least {min_disk} (preflight_min_free_disk_gb): free space, "
                        "point preflight_data_path at the data disk, or lower the threshold")
    if check_type_bool(settings["require_ssd"]) and node.get("disk_rotational") is True:
        problems.append(f"the data disk under {data_path} ({node['disk_device']}) is a rotational disk "
                        "(preflight_require_ssd): put the data on an SSD or NVMe drive")
    gpu_node = host in (groups.get("gpu_nodes") or [])
    promised = check_type_int(settings.get("gpus_per_node") or 0)
    min_gpus = settings["min_gpus_per_node"]
    if promised > 0 and gpu_node and node["nvidia_gpus"] < promised:
        # The inventory's promise is checked whatever preflight_require_gpus says: a node that lost a GPU is the
        # common case (XID 79, fallen off the bus), and training would start with fewer ranks than planned.
        problems.append(f"{node['nvidia_gpus']} NVIDIA GPU(s) on the PCI bus, the inventory promises {promised} "
                        "(cluster_gpus_per_node): reseat or replace the missing GPUs (look for XID 79 in dmesg), or "
                        "correct cluster_gpus_per_node for this host")
    elif (check_type_bool(settings["require_gpus"]) and gpu_node
          and node["nvidia_gpus"] < check_type_int(min_gpus)):
        problems.append(f"{node['nvidia_gpus']} NVIDIA GPU(s) on the PCI bus, needs at least {min_gpus} "
                        "(preflight_min_gpus_per_node): check the GPUs are seated and enabled in the BIOS, or move "
                        "this host out of gpu_nodes")
    return problems


def network_problems(pings, host, settings):
    """One problem per pair from host that fails, each naming the pair, the variable and the fix.

    pings: the output of the role's ping_peers.py, one report per peer (peer, address, reachable, rtt_avg_ms,
    mtu_payload, mtu_ok, error). settings: max_rtt_ms (preflight_max_rtt_ms) and mtu (cluster_mtu)."""
    problems = []
    max_rtt, mtu = settings["max_rtt_ms"], settings["mtu"]
    for ping in pings:
        pair = f"{host} -> {ping['peer']} ({ping['address']})"
        if ping.get("error"):
            problems.append(f"{pair}: {ping['error']}")
        elif not ping.get("reachable"):
            problems.append(f"{pair}: no answer to ping: check that the node is up and that ICMP is allowed between "
                            "nodes")
        else:
            if ping["rtt_avg_ms"] > check_type_float(max_rtt):
                problems.append(f"{pair}: round trip {float(ping['rtt_avg_ms']):.3f} ms, above {max_rtt} ms "
                                "(preflight_max_rtt_ms): put the nodes on one switch or raise the threshold")
            if not ping.get("mtu_ok"):
                problems.append(f"{pair}: a ping of {ping['mtu_payload']} bytes with don't-fragment (cluster_mtu {mtu} "
                                f"minus 28) did not pass: set MTU {mtu} on both interfaces and the switch ports, or "
                                "lower cluster_mtu")
    return problems


# ------------------------------------------------------------------------------------------------ day 2


def day2_problems(knobs, targets, play_hosts):
    """The day-2 playbooks' own checks, beyond their argument specs.

    knobs: the day-2 variables as set ({name: value}); targets: {knob or pattern description: the inventory
    hosts it names}; play_hosts: the hosts this run may touch (after --limit)."""
    problems = []
    batch = knobs.get("day2_rolling_upgrade_batch")
    if batch is not None:
        text = str(batch).strip()
        match = re.fullmatch(r"([0-9]+)(%?)", text)
        if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(1)) > 100):
            problems.append(f"day2_rolling_upgrade_batch is '{batch}': give a number of nodes (1 or more) or a "
                            "percentage from 1% to 100%, e.g. 25%")
    # A drain timeout of 0 means "do not wait for jobs"; a node cannot come back from a reboot in 0 s.
    for knob, least in (("day2_rolling_upgrade_drain_timeout", 0), ("day2_remove_node_drain_timeout", 0),
                        ("day2_rolling_upgrade_reboot_timeout", 1)):
        if knobs.get(knob) is not None and (_int(knobs[knob]) is None or _int(knobs[knob]) < least):
            problems.append(f"{knob} is {knobs[knob]!r}: give a number of seconds, {least} or more")
    for what, hosts in targets.items():
        if not hosts:
            problems.append(f"{what} matches no host of the inventory: name hosts or groups that the inventory has "
                            "(ansible-inventory --graph lists them)")
        elif not set(hosts) & set(play_hosts):
            problems.append(f"{what} ({', '.join(sorted(hosts))}) lies outside --limit "
                            f"({', '.join(sorted(play_hosts))}): widen --limit or leave it out")
    return problems


class FilterModule:
    def filters(self):
        return {"preflight_inventory_problems": inventory_problems, "preflight_day2_problems": day2_problems,
                "preflight_unknown_variables": unknown_variable_problems, "preflight_known_variables": known_variables,
                "preflight_node_problems": node_problems, "preflight_network_problems": network_problems}
