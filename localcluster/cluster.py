#!/usr/bin/env python3
"""The local cluster: podman containers that stand in for servers, on this machine.

  cluster.py up --nodes N     build the node image if its recipe changed, start the package cache and
                              N systemd nodes on a jumbo-MTU network, write inventories/local/hosts.yml
  cluster.py down             remove every container and network this tool made (found by label)
  cluster.py cache-up         only the network and the package cache (molecule scenarios use them)
  cluster.py status           what is running

Ansible reaches the nodes over SSH on their addresses with a key made here, as it reaches servers.
Everything this tool creates carries the label io.sd3-cluster.owned=true and nothing else is touched.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = REPO / ".cluster"
STATE_DIR = Path(os.environ.get("SD3_STATE_DIR", "/var/lib/sd3-cluster"))
CACHE_DIR = Path(os.environ.get("SD3_CACHE_DIR", "/var/cache/sd3-cluster"))
INVENTORY = REPO / "inventories" / "local" / "hosts.yml"
LABEL = "io.sd3-cluster.owned=true"
NETWORK = os.environ.get("SD3_NETWORK", "sd3-cluster")
SUBNET = ipaddress.ip_network(os.environ.get("SD3_SUBNET", "10.213.0.0/24"))
MTU = int(os.environ.get("SD3_MTU", "9000"))
CACHE_CONTAINER = "sd3-pkgcache"
CACHE_PORT = 3142
# Node i gets the address .100+i; podman hands out the others (molecule nodes) from the bottom.
NODE_ADDRESS_BASE = 100
CACHE_ADDRESS_OFFSET = 250
WHEELS = Path("/opt/wheels")


class ClusterError(Exception):
    """A failure with a message for the user; printed without a traceback."""


def log(message: str) -> None:
    print(f"[cluster] {message}", flush=True)


def run(*args: str, check: bool = True, capture: bool = True, input_text: str | None = None) -> str:
    result = subprocess.run(args, capture_output=capture, text=True, input=input_text, check=False)
    if check and result.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed ({result.returncode}): {(result.stderr or '').strip()[-2000:]}")
    return (result.stdout or "").strip()


def podman(*args: str, check: bool = True) -> str:
    return run("podman", *args, check=check)


class Timer:
    """Prints a line per phase with the seconds it took."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        self.start = time.monotonic()
        log(f"{self.what} ...")
        return self

    def __exit__(self, kind, *_):
        if kind is None:
            log(f"{self.what}: done in {time.monotonic() - self.start:.1f} s")


def node_name(index: int) -> str:
    return f"node{index}"


def container_name(index: int) -> str:
    return f"sd3-{node_name(index)}"


def node_address(index: int) -> str:
    return str(SUBNET.network_address + NODE_ADDRESS_BASE + index)


def cache_address() -> str:
    return str(SUBNET.network_address + CACHE_ADDRESS_OFFSET)


def check_host() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the local cluster needs root (privileged systemd containers): run `sudo make demo`")
    if shutil.which("podman") is None:
        raise ClusterError("podman is not installed: run `make host-prereqs` (apt-get install podman runc debootstrap)")
    if not os.environ.get("CONTAINERS_CONF"):
        os.environ["CONTAINERS_CONF"] = str(REPO / "localcluster" / "containers.conf")


def node_image() -> str:
    with Timer("node image (built once per recipe)"):
        out = run("bash", str(REPO / "localcluster" / "node-image.sh"), capture=True)
    return out.splitlines()[-1].strip()


def owned(kind: str) -> list[str]:
    """Names of our containers or networks, found by label."""
    if kind == "container":
        out = podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}")
    else:
        out = podman("network", "ls", "--filter", f"label={LABEL}", "--format", "{{.Name}}")
    return [line for line in out.splitlines() if line]


def ensure_network() -> None:
    if NETWORK in owned("network"):
        return
    if subprocess.run(["podman", "network", "exists", NETWORK], check=False).returncode == 0:
        raise ClusterError(f"a podman network named {NETWORK} exists but was not made by this tool: "
                           f"remove it or set SD3_NETWORK to another name")
    podman("network", "create", "--label", LABEL, "--subnet", str(SUBNET), "--opt", f"mtu={MTU}", NETWORK)
    log(f"network {NETWORK} {SUBNET} MTU {MTU} created")


# apt-cacher-ng settings of ours, written on every start of the cache container.
# FreshIndexMaxAge: a package list fetched in the last 30 minutes is served from the cache without
# asking the mirror again. With the default (27 s) every scenario's `apt-get update` reached Debian's
# mirror, and a 30 s spell of 503 answers from it failed a CI run (gpu_stack converge, 2026-12-03).
CACHE_SETTINGS = "FreshIndexMaxAge: 1800\n"


def cache_answers() -> bool:
    """True when the cache container runs and its port takes a connection (podman's own state can
    say "running" for a container whose processes are gone, e.g. after the host froze them)."""
    result = subprocess.run(["podman", "exec", CACHE_CONTAINER, "bash", "-c",
                             f"(exec 3<>/dev/tcp/127.0.0.1/{CACHE_PORT}) 2>/dev/null"],
                            capture_output=True, check=False)
    return result.returncode == 0


def node_answers(name: str) -> bool:
    """True when the node's container runs a process we can exec into. After the host restarted, podman's
    state can still say "running" for a container whose processes are gone."""
    return subprocess.run(["podman", "exec", name, "true"], capture_output=True, check=False).returncode == 0


def ensure_cache(image: str) -> None:
    """apt-cacher-ng in a container of its own, its cache on the host: a second run downloads nothing."""
    proxy_conf = STATE_DIR / "apt-proxy.conf"
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    # Retries: Debian's mirror answers the cache with 503 now and then; apt waits 1, 2, 4, ... 30 s
    # between tries (Acquire::Retries::Delay), so 10 tries outlast about three minutes of it.
    proxy_conf.write_text(f'Acquire::http::Proxy "http://{cache_address()}:{CACHE_PORT}";\n'
                          'Acquire::Retries "10";\n')
    if CACHE_CONTAINER in owned("container"):
        if cache_answers():
            return
        log(f"{CACHE_CONTAINER} does not answer on port {CACHE_PORT}: starting it anew")
        podman("rm", "-f", "-t", "5", CACHE_CONTAINER)
    cache_dir = CACHE_DIR / "apt-cacher-ng"
    cache_dir.mkdir(parents=True, exist_ok=True)
    # apt-cacher-ng is installed once and kept as an image of its own, so no later run downloads it.
    cache_image = image.replace("/sd3-node:", "/sd3-pkgcache:")
    have_image = subprocess.run(["podman", "image", "exists", cache_image], check=False).returncode == 0
    with Timer("package cache (apt-cacher-ng)"):
        podman("run", "-d", "--name", CACHE_CONTAINER, "--hostname", "pkgcache", "--label", LABEL,
               "--network", NETWORK, "--ip", cache_address(), "--systemd=always",
               "-v", f"{cache_dir}:/var/cache/apt-cacher-ng", cache_image if have_image else image, "/sbin/init")
        wait_for_systemd(CACHE_CONTAINER)
        # The service may only start once its cache (a host folder) belongs to its user.
        script = (
            "set -e; if ! command -v apt-cacher-ng >/dev/null; then "
            "printf '#!/bin/sh\\nexit 101\\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; "
            "apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq apt-cacher-ng >/dev/null; "
            "rm -f /usr/sbin/policy-rc.d; fi; "
            "chown -R apt-cacher-ng:apt-cacher-ng /var/cache/apt-cacher-ng; "
            # apt-cacher-ng reads every *.conf of its folder, in name order: ours comes last and wins.
            f"printf '{CACHE_SETTINGS}' > /etc/apt-cacher-ng/zz-sd3-cluster.conf; "
            "systemctl restart apt-cacher-ng; "
            f"for i in $(seq 60); do (exec 3<>/dev/tcp/127.0.0.1/{CACHE_PORT}) 2>/dev/null && exit 0; sleep 0.5; done; "
            "echo 'apt-cacher-ng did not start' >&2; exit 1")
        podman("exec", CACHE_CONTAINER, "bash", "-c", script)
        if not have_image:
            podman("commit", "-q", CACHE_CONTAINER, cache_image)


def wait_for_systemd(container: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = podman("exec", container, "systemctl", "is-system-running", check=False)
        if state in ("running", "degraded"):
            return
        time.sleep(1)
    raise ClusterError(f"systemd in {container} did not finish booting in {timeout:.0f} s (state: {state!r}); "
                       f"see `podman exec {container} systemctl --failed`")


def ssh_key() -> Path:
    key = STATE / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sd3-cluster-local-ansible", "-f", str(key))
    return key


def start_node(index: int, image: str, key: Path) -> None:
    name = container_name(index)
    args = ["run", "-d", "--name", name, "--hostname", node_name(index), "--label", LABEL,
            "--label", "io.sd3-cluster.role=node", "--network", NETWORK, "--ip", node_address(index),
            "--network-alias", node_name(index), "--privileged", "--systemd=always",
            # What Docker inside a node needs (ENVIRONMENT.md): the host's cgroup namespace, writable.
            "--cgroupns=host", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw",
            "-v", f"{STATE_DIR / 'apt-proxy.conf'}:/etc/apt/apt.conf.d/01sd3-proxy:ro",
            "-v", f"{CACHE_DIR / 'pip'}:/var/cache/sd3-pip"]
    if WHEELS.is_dir():
        args += ["-v", f"{WHEELS}:{WHEELS}:ro"]
    (CACHE_DIR / "pip").mkdir(parents=True, exist_ok=True)
    podman(*args, image, "/sbin/init")
    wait_for_systemd(name)
    run("podman", "exec", "-i", name, "bash", "-c",
        "install -d -m 0700 /root/.ssh && install -m 0600 /dev/stdin /root/.ssh/authorized_keys",
        input_text=key.with_suffix(".pub").read_text())


def host_keys(index: int, timeout: float = 60) -> list[str]:
    """The node's SSH host keys, under its name and its address, for a strict known_hosts file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = run("ssh-keyscan", "-T", "2", node_address(index), check=False)
        lines = [line for line in out.splitlines() if line and not line.startswith("#")]
        if lines:
            return [f"{node_name(index)},{line}" for line in lines]
        time.sleep(1)
    raise ClusterError(f"sshd on {node_name(index)} ({node_address(index)}) did not answer in {timeout:.0f} s; "
                       f"see `podman exec {container_name(index)} journalctl -u ssh`")


def _topology():
    """The repository's storage topology rules (ansible/plugins/module_utils/topology.py), loaded by path:
    the same replica-set rule the roles and preflight apply."""
    loader = Path(__file__).resolve().parents[1] / "ansible" / "plugins" / "module_utils" / "source_tree.py"
    return runpy.run_path(str(loader))["load"]("ansible/plugins/module_utils/topology.py")


def layout(count: int) -> dict[str, list[str]]:
    """Groups for N nodes: node1 is the head; the others train (all of them when N < 3); storage is
    the largest multiple of the replica count, so bricks always come in whole replica sets."""
    nodes = [node_name(i) for i in range(1, count + 1)]
    replica = min(3, count)
    gpu_nodes = nodes[1:] if count >= 3 else nodes
    storage = _topology().storage_node_count(count, replica)
    return {"head": nodes[:1], "gpu_nodes": gpu_nodes, "storage_nodes": nodes[:storage],
            "replica": replica}


def write_inventory(count: int, key: Path) -> None:
    groups = layout(count)
    known_hosts = STATE / "known_hosts"
    lines = [
        "---",
        "# Generated by `make cluster-up` (localcluster/cluster.py); do not edit.",
        "# The settings of the local cluster are in group_vars/ beside this file.",
        "all:",
        "  vars:",
        "    ansible_user: root",
        f"    ansible_ssh_private_key_file: {key}",
        f"    ansible_ssh_common_args: -o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes",
        f"    cluster_network_cidr: {SUBNET}",
        f"    cluster_mtu: {MTU}",
        f"    cluster_storage_replica: {groups['replica']}",
        "    # This machine reaches the nodes from the network's gateway: the firewall lets it open SSH.",
        f"    cluster_admin_cidrs: [{next(SUBNET.hosts())}/32]",
        "  hosts:",
    ]
    for i in range(1, count + 1):
        lines += [f"    {node_name(i)}:", f"      ansible_host: {node_address(i)}"]
    lines.append("  children:")
    for group in ("head", "gpu_nodes", "storage_nodes"):
        lines += [f"    {group}:", "      hosts:"] + [f"        {host}:" for host in groups[group]]
    INVENTORY.write_text("\n".join(lines) + "\n")


def up(count: int) -> None:
    if count < 1:
        raise ClusterError("NODES must be 1 or more")
    check_host()
    total = time.monotonic()
    image = node_image()
    ensure_network()
    ensure_cache(image)
    key = ssh_key()
    running = set(owned("container"))
    with Timer(f"{count} node(s)"):
        for index in range(1, count + 1):
            name = container_name(index)
            if name in running and not node_answers(name):
                # A node left stopped (a killed session, a reboot) has lost its state: make it anew.
                log(f"{name} does not run (podman says {podman('inspect', '-f', '{{.State.Status}}', name)}): "
                    "starting it anew")
                podman("rm", "-f", "-t", "0", name)
                running.discard(name)
            if name in running:
                current = podman("inspect", "-f", "{{.ImageName}}", name)
                if current != image:
                    log(f"{name} runs {current}, not the newest {image}: `make cluster-down` to rebuild it")
                continue
            start_node(index, image, key)
            log(f"{node_name(index)} up at {node_address(index)}")
        extra = sorted(n for n in running if n.startswith("sd3-node") and
                       n.removeprefix("sd3-node").isdigit() and int(n.removeprefix("sd3-node")) > count)
        for name in extra:
            podman("rm", "-f", "-t", "5", name)
            log(f"{name} removed (NODES={count})")
    with Timer("SSH host keys"):
        known = [line for i in range(1, count + 1) for line in host_keys(i)]
        (STATE / "known_hosts").write_text("\n".join(known) + "\n")
    write_inventory(count, key)
    shutil.rmtree(REPO / ".cache" / "ansible-facts", ignore_errors=True)
    log(f"inventory written to {INVENTORY.relative_to(REPO)}; cluster up in {time.monotonic() - total:.1f} s")


def cache_up() -> None:
    check_host()
    image = node_image()
    ensure_network()
    ensure_cache(image)
    log(f"package cache at http://{cache_address()}:{CACHE_PORT} on network {NETWORK}")


def down() -> None:
    """Removes our nodes; the network and the package cache too unless another container (a molecule
    scenario's node) still uses the network, because removing a network takes its containers with it."""
    check_host()
    nodes = [name for name in owned("container") if name != CACHE_CONTAINER]
    if nodes:
        podman("rm", "-f", "-t", "5", *nodes)
    INVENTORY.unlink(missing_ok=True)
    others = [name for name in podman("ps", "-a", "--filter", f"network={NETWORK}", "--format", "{{.Names}}").split()
              if name != CACHE_CONTAINER]
    if others:
        log(f"removed {len(nodes)} node(s); the network {NETWORK} and the package cache stay: "
            f"{', '.join(others)} still use them")
        return
    if CACHE_CONTAINER in owned("container"):
        podman("rm", "-f", "-t", "5", CACHE_CONTAINER)
    for network in owned("network"):
        podman("network", "rm", network)
    reset_ipam_if_unused()
    log(f"removed {len(nodes)} node(s), the package cache container and the network; "
        f"the image and the cached packages are kept")


# netavark's address allocations (podman 4.3). `podman network rm` leaves them behind, and a container
# that died mid-teardown keeps its address there forever: a fixed `--ip` then fails with "IPAM error:
# requested ip address ... is already allocated to container ID ..." for a container that is gone.
IPAM_DB = Path("/run/containers/networks/ipam.db")


def reset_ipam_if_unused() -> None:
    """Forget every allocation, but only when no container exists on this host: then none is in use."""
    if IPAM_DB.exists() and not podman("ps", "-aq").split():
        IPAM_DB.unlink()
        log(f"no container left on this host: address allocations reset ({IPAM_DB}), stale ones included")


def status() -> None:
    check_host()
    out = podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "json")
    for item in json.loads(out or "[]"):
        print(f"{item['Names'][0]:16} {item['State']:10} {item['Image']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up").add_argument("--nodes", type=int, default=3)
    sub.add_parser("down")
    sub.add_parser("cache-up")
    sub.add_parser("status")
    args = parser.parse_args()
    try:
        if args.command == "up":
            up(args.nodes)
        elif args.command == "down":
            down()
        elif args.command == "cache-up":
            cache_up()
        else:
            status()
    except ClusterError as err:
        print(f"[cluster] error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
