#!/usr/bin/env python3
"""Ansible dynamic inventory from the pulumi/aws stack: `ansible-playbook site.yml -i inventories/cloud`.

Reads the stack's outputs with `pulumi stack output --json --show-secrets` (in pulumi/aws, or
$SD3_PULUMI_DIR, stack $SD3_PULUMI_STACK when set), or from a saved copy of them named by $SD3_PULUMI_OUTPUTS
(`pulumi stack output --json > outputs.json`), and prints the `ansible_inventory` output that the stack built.

The stack made every node's SSH host key (pulumi/aws/sd3_aws/host_keys.py) and put the known_hosts lines into
the inventory; they are written to $SD3_KNOWN_HOSTS (default ~/.ssh/sd3-<cluster>.known_hosts), which every
connection of the inventory checks host keys against (StrictHostKeyChecking=yes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REQUIRED_GROUPS = ("head", "gpu_nodes", "storage_nodes")
DEFAULT_PROJECT_DIR = Path(__file__).resolve().parents[2] / "pulumi" / "aws"


class InventoryError(RuntimeError):
    """The stack outputs could not be read or do not hold an inventory; the message says what to do."""


def read_outputs(environ: dict[str, str]) -> dict[str, Any]:
    saved = environ.get("SD3_PULUMI_OUTPUTS")
    if saved:
        try:
            text = Path(saved).read_text(encoding="utf-8")
        except OSError as error:
            raise InventoryError(f"SD3_PULUMI_OUTPUTS names {saved}, which cannot be read ({error.strerror}): "
                                 "save the outputs with `pulumi stack output --json > FILE`") from None
        source = saved
    else:
        project = environ.get("SD3_PULUMI_DIR", str(DEFAULT_PROJECT_DIR))
        command = ["pulumi", "stack", "output", "--json", "--show-secrets", "--cwd", project]
        if environ.get("SD3_PULUMI_STACK"):
            command += ["--stack", environ["SD3_PULUMI_STACK"]]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120)
        except FileNotFoundError:
            raise InventoryError("the pulumi CLI is not on PATH: install it, or point SD3_PULUMI_OUTPUTS at a saved "
                                 "`pulumi stack output --json`") from None
        if done.returncode != 0:
            raise InventoryError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.stdout.strip()}; "
                                 "run `pulumi up` in pulumi/aws first, or select the stack with SD3_PULUMI_STACK")
        text, source = done.stdout, f"pulumi stack output in {project}"
    try:
        outputs = json.loads(text)
    except json.JSONDecodeError as error:
        raise InventoryError(f"{source} is not JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(outputs, dict):
        raise InventoryError(f"{source} is not a JSON object of stack outputs")
    return outputs


def inventory_from_outputs(outputs: dict[str, Any]) -> dict[str, Any]:
    inventory = outputs.get("ansible_inventory")
    if not isinstance(inventory, dict):
        raise InventoryError("the stack outputs hold no `ansible_inventory`: is this the pulumi/aws stack of "
                             "sd3-cluster, and has `pulumi up` finished?")
    missing = [group for group in REQUIRED_GROUPS if group not in inventory]
    if missing or "_meta" not in inventory:
        raise InventoryError(f"the stack's ansible_inventory lacks {', '.join(missing) or '_meta'}: "
                             "re-run `pulumi up` with this version of pulumi/aws")
    return inventory


def write_known_hosts(inventory: dict[str, Any], environ: dict[str, str]) -> None:
    """Write the stack's known_hosts lines where the inventory's SSH options look (pulumi_known_hosts_file)."""
    variables = inventory.setdefault("all", {}).setdefault("vars", {})
    lines = variables.get("pulumi_known_hosts")
    if not isinstance(lines, list) or not lines:
        raise InventoryError("the stack's ansible_inventory holds no host keys (pulumi_known_hosts): re-run "
                             "`pulumi up` with this version of pulumi/aws")
    default = Path.home() / ".ssh" / f"sd3-{variables.get('pulumi_cluster_name', 'cluster')}.known_hosts"
    path = Path(environ.get("SD3_KNOWN_HOSTS") or default).expanduser().resolve()
    text = "".join(f"{line}\n" for line in lines)
    try:
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(text, encoding="utf-8")
            partial.replace(path)
    except OSError as error:
        raise InventoryError(f"cannot write the cluster's known_hosts to {path} ({error.strerror}): point "
                             "SD3_KNOWN_HOSTS at a writable file") from None
    variables["pulumi_known_hosts_file"] = str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the whole inventory (what Ansible asks)")
    parser.add_argument("--host", help="print one host's variables (empty: --list carries them in _meta)")
    args = parser.parse_args(argv)
    try:
        inventory = inventory_from_outputs(read_outputs(dict(os.environ)))
        write_known_hosts(inventory, dict(os.environ))
    except InventoryError as error:
        print(f"inventories/cloud: {error}", file=sys.stderr)
        return 1
    if args.host:
        print(json.dumps(inventory["_meta"]["hostvars"].get(args.host, {})))
    else:
        print(json.dumps(inventory, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
