"""Jinja filters for addresses and networks, built on Python's ipaddress (no netaddr needed)."""
import ipaddress


def is_ip_address(value):
    """True when value is an IPv4 or IPv6 address."""
    try:
        ipaddress.ip_address(str(value))
    except ValueError:
        return False
    return True


def is_ip_network(value):
    """True when value is a network in CIDR form with no host bits set, e.g. 10.10.0.0/24."""
    try:
        ipaddress.ip_network(str(value), strict=True)
    except ValueError:
        return False
    return "/" in str(value)


def ip_in_network(address, network):
    """True when address lies inside network."""
    try:
        return ipaddress.ip_address(str(address)) in ipaddress.ip_network(str(network), strict=False)
    except ValueError:
        return False


def cluster_address(host, hostvars, default=None):
    """A node's address on the cluster network: its cluster_address, else its ansible_host, else its inventory
    name (the rule of roles/README.md), or `default` where one is given (e.g. '' where a name will not do).
    hostvars: Ansible's hostvars, or any mapping of host -> variables."""
    variables = hostvars[host]
    for key in ("cluster_address", "ansible_host"):
        value = variables.get(key)
        if value not in (None, ""):
            return str(value)
    return str(host) if default is None else default


def nodes_without_address(hosts, hostvars):
    """The hosts (in order) that set neither cluster_address nor ansible_host."""
    return [host for host in hosts or [] if cluster_address(host, hostvars, "") == ""]


class FilterModule:
    def filters(self):
        return {"is_ip_address": is_ip_address, "is_ip_network": is_ip_network, "ip_in_network": ip_in_network,
                "cluster_address": cluster_address, "nodes_without_address": nodes_without_address}
