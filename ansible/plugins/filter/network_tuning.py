"""Jinja filters of the network_tuning role: the sysctl profile sized to bandwidth x RTT, which of its
keys a node in a container may apply, and where the cluster interface is declared.

Pure functions of their arguments, so tests/network calls them directly.
"""

import base64
import ipaddress
import re
import runpy
from pathlib import Path

# Filters cannot import each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
is_ip_network = _load("ansible/plugins/filter/cluster_network.py").is_ip_network

MIB = 1 << 20
# Linux charges socket buffers with per-packet overhead (skb truesize), so a buffer of twice the
# bandwidth-delay product still holds a full window; below 16 MiB a large buffer costs nothing.
BUFFER_FACTOR = 2
MIN_BUFFER = 16 * MIB
MAX_BUFFER = 1024 * MIB
# Packets the kernel may queue per CPU between the NIC's interrupt and the protocol stack; values
# from NIC vendors' tuning guides for each speed class (the kernel's default 1000 drops bursts at 25G+).
BACKLOG_BY_SPEED = ((10, 30000), (25, 100000), (100, 250000))
SPEEDS_GBPS = (10, 25, 40, 50, 100, 200, 400)
# Keys that live in the node's own network namespace: a container may apply them without touching the
# host. Everything else (vm.*, kernel.*, net.core.*) is global, or treated as global to be safe.
NETNS_PREFIXES = ("net.ipv4.", "net.ipv6.")
NETPLAN_SECTIONS = ("ethernets", "bonds", "bridges", "vlans")


try:
    from ansible.errors import AnsibleFilterError as _FilterError
except ImportError:  # the unit tests also run without Ansible
    _FilterError = ValueError


class NetworkTuningError(_FilterError):
    """A bad argument to a filter; the message names it."""


def _next_power_of_two(value):
    return 1 << max(0, int(value - 1).bit_length())


def bandwidth_delay_bytes(speed_gbps, rtt_ms):
    """Bytes in flight on a link of speed_gbps with a round trip of rtt_ms."""
    return int(float(speed_gbps) * 1e9 / 8 * float(rtt_ms) / 1e3)


def socket_buffer_bytes(speed_gbps, rtt_ms):
    """The socket buffer limit for one TCP stream to fill the link: BUFFER_FACTOR x BDP, a power of two,
    at least MIN_BUFFER and at most MAX_BUFFER."""
    wanted = BUFFER_FACTOR * bandwidth_delay_bytes(speed_gbps, rtt_ms)
    return min(MAX_BUFFER, max(MIN_BUFFER, _next_power_of_two(wanted)))


def netdev_backlog(speed_gbps):
    backlog = BACKLOG_BY_SPEED[0][1]
    for speed, value in BACKLOG_BY_SPEED:
        if float(speed_gbps) >= speed:
            backlog = value
    return backlog


def sysctl_profile(speed_gbps, rtt_ms=1.0, congestion_control="cubic", default_qdisc="fq", busy_poll_us=0,
                   mtu_probing=1, overrides=None):
    """The sysctl settings for a link of speed_gbps (one of SPEEDS_GBPS) and a design round trip of rtt_ms,
    as an ordered dict of key -> value string. overrides are merged last; an override of None or '' drops
    the key."""
    try:
        speed = int(speed_gbps)
        rtt = float(rtt_ms)
    except (TypeError, ValueError) as err:
        raise NetworkTuningError(f"link speed {speed_gbps!r} Gbit/s and RTT {rtt_ms!r} ms must be numbers") from err
    if speed not in SPEEDS_GBPS:
        choices = ", ".join(map(str, SPEEDS_GBPS))
        raise NetworkTuningError(f"link speed {speed} Gbit/s has no profile: use one of {choices}")
    if not 0 < rtt <= 100:
        raise NetworkTuningError(f"RTT {rtt} ms is outside 0-100 ms: give the round trip between two nodes")
    buffer = socket_buffer_bytes(speed, rtt)
    profile = {
        "net.core.rmem_max": buffer,
        "net.core.wmem_max": buffer,
        # ancillary buffers per socket: MSG_ZEROCOPY and many in-flight sends need more than 20 KiB
        "net.core.optmem_max": MIB,
        "net.core.netdev_max_backlog": netdev_backlog(speed),
        # hundreds of ranks connect to one rendezvous store at once at the start of a job
        "net.core.somaxconn": 8192,
        "net.core.default_qdisc": default_qdisc,
        "net.ipv4.tcp_rmem": f"4096 131072 {buffer}",
        "net.ipv4.tcp_wmem": f"4096 65536 {buffer}",
        "net.ipv4.tcp_max_syn_backlog": 8192,
        "net.ipv4.tcp_congestion_control": congestion_control,
        "net.ipv4.tcp_mtu_probing": int(mtu_probing),
        # collective traffic comes in bursts, one per step: keep the window open between them
        "net.ipv4.tcp_slow_start_after_idle": 0,
        # a window learned on a congested connection must not cap the next one
        "net.ipv4.tcp_no_metrics_save": 1,
    }
    if int(busy_poll_us) > 0:
        profile["net.core.busy_poll"] = int(busy_poll_us)
        profile["net.core.busy_read"] = int(busy_poll_us)
    for key, value in (overrides or {}).items():
        if value is None or str(value) == "":
            profile.pop(key, None)
        else:
            profile[key] = value
    return {key: " ".join(str(value).split()) for key, value in profile.items()}


def sysctl_is_netns_local(key):
    """True when the key belongs to the network namespace, so a container node may apply it."""
    return str(key).startswith(NETNS_PREFIXES)


def sysctl_applicable(profile, nodes_are_containers):
    """The part of profile that may be applied: all of it on a real machine, the network-namespace keys
    only when the node is a container."""
    if not nodes_are_containers:
        return dict(profile)
    return {key: value for key, value in profile.items() if sysctl_is_netns_local(key)}


def _addresses(iface_facts):
    ipv4 = iface_facts.get("ipv4") or {}
    found = [ipv4] if isinstance(ipv4, dict) and ipv4.get("address") else []
    found += [a for a in iface_facts.get("ipv4_secondaries") or [] if a.get("address")]
    found += [a for a in iface_facts.get("ipv6") or [] if a.get("address")]
    return [a["address"] for a in found]


def cluster_interface(facts, cidr, address=""):
    """The interface carrying the cluster network, from Ansible's network facts: the one holding address
    when it is given, otherwise the first with an address inside cidr. Returns {name, address, mtu,
    macaddress}, or {} when no interface qualifies."""
    network = ipaddress.ip_network(str(cidr), strict=False)
    candidates = []
    for name in sorted(facts.get("interfaces") or []):
        iface = facts.get(name.replace("-", "_").replace(".", "_")) or facts.get(name) or {}
        for addr in _addresses(iface):
            try:
                ip = ipaddress.ip_address(addr.split("%")[0])
            except ValueError:
                continue
            if ip.version == network.version and ip in network:
                candidates.append((str(ip) != str(address), name, str(ip), iface))
    if not candidates:
        return {}
    _, name, ip, iface = min(candidates, key=lambda c: (c[0], c[1]))
    return {"name": name, "address": ip, "mtu": int(iface.get("mtu") or 0), "macaddress": iface.get("macaddress", "")}


def netplan_device(documents, interface):
    """Where netplan declares interface: {section, id} of the first device whose id, set-name or
    match.name is the interface, across the parsed netplan files in order; {} when none does."""
    for document in documents or []:
        network = (document or {}).get("network") or {}
        for section in NETPLAN_SECTIONS:
            for device_id, declared in (network.get(section) or {}).items():
                device = declared or {}
                names = {device_id, device.get("set-name"), (device.get("match") or {}).get("name")}
                if interface in names:
                    return {"section": section, "id": device_id}
    return {}


def ifupdown_file(slurped, interface):
    """The path of the first ifupdown file (slurp results: {source, content in base64}) with an
    `iface <interface> ...` stanza; '' when none has one."""
    stanza = re.compile(rf"^\s*iface\s+{re.escape(str(interface))}\s", re.MULTILINE)
    for item in slurped or []:
        if "content" not in item:
            continue
        text = base64.b64decode(item["content"]).decode("utf-8", errors="replace")
        if stanza.search(text):
            return item.get("source", "")
    return ""


def _whole(value):
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def input_problems(host, settings, interfaces, iface, mtu_range, persist_methods):
    """The role's settings that cannot work on host, as one message ("HOST: nothing was changed." and a sentence
    per problem naming the variable and the fix), or "" when they may go on. settings: the role's variables
    without their network_tuning_ prefix (cidr, interface, address, mtu, mtu_persist); interfaces: the node's
    interface names (its facts); iface: the interface picked for the cluster network ({} when none)."""
    cidr, interface = settings.get("cidr"), str(settings.get("interface") or "")
    problems = []
    # The interface checks follow from the network: one sentence for the first that fails.
    if not is_ip_network(cidr):
        problems.append(f"network_tuning_cidr (cluster_network_cidr) is '{cidr}', not a network: set it in "
                        "group_vars/all, e.g. 10.10.0.0/24.")
    elif interface and interface not in interfaces:
        problems.append(f"network_tuning_interface is '{interface}' but this node has only "
                        f"{', '.join(sorted(interfaces))}: fix the name or set it to \"\" to detect it.")
    elif not (iface or {}).get("name"):
        problems.append(f"no interface has an address in network_tuning_cidr {cidr} (this node's cluster_address is "
                        f"'{settings.get('address') or ''}'): put the node on the cluster network, fix "
                        "cluster_address, or name the interface in network_tuning_interface.")
    mtu, (least, most) = _whole(settings.get("mtu")), mtu_range
    if mtu is None or not least <= mtu <= most:
        problems.append(f"network_tuning_mtu (cluster_mtu) is {settings.get('mtu')}: use {least} to {most} (1500 plain "
                        "Ethernet, 9000 jumbo frames).")
    if settings.get("mtu_persist") not in persist_methods:
        problems.append(f"network_tuning_mtu_persist is '{settings.get('mtu_persist')}': choose one of "
                        f"{', '.join(persist_methods)}.")
    return f"{host}: nothing was changed. " + " ".join(problems) if problems else ""


class FilterModule:
    def filters(self):
        return {
            "network_tuning_input_problems": input_problems,
            "network_tuning_sysctl_profile": sysctl_profile,
            "network_tuning_sysctl_applicable": sysctl_applicable,
            "network_tuning_cluster_interface": cluster_interface,
            "network_tuning_netplan_device": netplan_device,
            "network_tuning_ifupdown_file": ifupdown_file,
        }
