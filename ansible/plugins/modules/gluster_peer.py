#!/usr/bin/python
"""Ansible module: keep peers in this node's GlusterFS trusted pool (reads `gluster pool list --xml` first)."""
from __future__ import annotations

import time
import xml.etree.ElementTree as ET

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: gluster_peer
short_description: Keep nodes in the GlusterFS trusted pool of the node it runs on
description:
  - Reads the pool with C(gluster pool list --xml), probes only the peers that are missing, then waits
    until every wanted peer is connected and in the cluster.
  - Never detaches a peer; removing a storage node is a day-2 operation (remove_node.yml).
  - Supports check mode (reports the peers it would probe).
options:
  peers:
    description: Addresses or host names that must be in the pool, as the other peers reach them.
    type: list
    elements: str
    required: true
  timeout:
    description: Seconds to wait for every wanted peer to be connected and in the cluster.
    type: int
    default: 60
author: sd3-cluster developers
"""

EXAMPLES = r"""
- name: Form the pool from the first storage node
  gluster_peer:
    peers: [10.0.0.12, 10.0.0.13]
"""

RETURN = r"""
probed:
  description: Peers that were probed (or would be, in check mode).
  type: list
  returned: always
pool:
  description: The pool after the change, one dict per peer (uuid, hostnames, connected, state).
  type: list
  returned: always
"""

IN_CLUSTER = "Peer in Cluster"


class GlusterError(Exception):
    """The gluster CLI failed or answered something we cannot read."""


def parse_cli_output(text):
    """The <cliOutput> root of gluster's XML; GlusterError when the command itself failed."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise GlusterError(f"gluster printed no readable XML ({err}): {text[:300]!r}") from err
    ret = root.findtext("opRet", "0").strip()
    if ret not in ("0", ""):
        raise GlusterError(root.findtext("opErrstr", "").strip() or f"gluster failed with opRet {ret}")
    return root


def parse_pool(text):
    """Peers of `gluster pool list --xml` (or `peer status --xml`): uuid, names, connected, state."""
    peers = []
    for peer in parse_cli_output(text).iter("peer"):
        names = [peer.findtext("hostname", "").strip()]
        names += [n.text.strip() for n in peer.findall("hostnames/hostname") if n.text]
        state = peer.findtext("stateStr", "").strip()
        local = names[0] == "localhost"
        peers.append({
            "uuid": peer.findtext("uuid", "").strip(),
            "hostnames": sorted(set(filter(None, names))),
            "connected": peer.findtext("connected", "0").strip() == "1",
            # The local node has no state: it is the pool by definition.
            "state": IN_CLUSTER if local and not state else state,
            "local": local,
        })
    return peers


def missing_peers(pool, wanted):
    """The wanted names that no peer of the pool answers to, in the order given."""
    known = {name for peer in pool for name in peer["hostnames"]}
    return [name for name in wanted if name not in known]


def unhealthy_peers(pool, wanted):
    """The wanted names whose peer is not both connected and in the cluster."""
    by_name = {name: peer for peer in pool for name in peer["hostnames"]}
    return [name for name in wanted
            if name not in by_name or not by_name[name]["connected"] or by_name[name]["state"] != IN_CLUSTER]


def main():
    module = AnsibleModule(
        argument_spec={"peers": {"type": "list", "elements": "str", "required": True},
                       "timeout": {"type": "int", "default": 60}},
        supports_check_mode=True,
    )
    gluster = module.get_bin_path("gluster", required=True)

    def pool_now():
        rc, out, err = module.run_command([gluster, "--mode=script", "pool", "list", "--xml"])
        if rc != 0 and not out:
            module.fail_json(msg=f"`gluster pool list` failed on this node ({err.strip()}): is glusterd running?")
        try:
            return parse_pool(out)
        except GlusterError as error:
            module.fail_json(msg=f"reading the trusted pool failed: {error}")

    wanted = [p for p in module.params["peers"] if p]
    pool = pool_now()
    to_probe = missing_peers(pool, wanted)
    if module.check_mode or (not to_probe and not unhealthy_peers(pool, wanted)):
        module.exit_json(changed=bool(to_probe), probed=to_probe, pool=pool)

    for name in to_probe:
        rc, out, err = module.run_command([gluster, "--mode=script", "peer", "probe", name])
        if rc != 0:
            module.fail_json(msg=f"`gluster peer probe {name}` failed: {(err or out).strip()}. Check that glusterd "
                             f"runs on {name} and that TCP 24007 is open between the storage nodes; a node that "
                             "already belongs to another pool must be detached there first.", probed=to_probe)

    deadline = time.monotonic() + module.params["timeout"]
    while True:
        pool = pool_now()
        waiting = unhealthy_peers(pool, wanted)
        if not waiting:
            break
        if time.monotonic() > deadline:
            module.fail_json(msg=f"peers {', '.join(waiting)} are not connected and in the cluster after "
                             f"{module.params['timeout']} s: check glusterd on them (systemctl status glusterd)",
                             pool=pool, probed=to_probe)
        time.sleep(1)
    module.exit_json(changed=bool(to_probe), probed=to_probe, pool=pool)


if __name__ == "__main__":
    main()
