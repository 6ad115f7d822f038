#!/usr/bin/env python3
"""GlusterFS brick and self-heal metrics from `gluster volume status` and `heal info summary` (XML), as a .prom file.

Runs on the storage nodes; any peer of the pool sees every volume, so the alerts take the worst value over nodes.
Where GlusterFS is absent or glusterd does not answer, the file says so (`sd3_gluster_up 0`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sd3_textfile import Family, render, write_atomically


def parse_status(xml_text: str) -> list[tuple[str, str, bool]]:
    """`gluster volume status all --xml` -> (volume, "host:/brick", online) for every brick (daemons left out)."""
    root = ET.fromstring(xml_text)
    bricks = []
    for volume in root.iter("volume"):
        name = volume.findtext("volName", "")
        for node in volume.findall("node"):
            host, path = node.findtext("hostname", ""), node.findtext("path", "")
            if not path.startswith("/"):
                continue  # Self-heal Daemon, quota daemon...: path is a host name there
            bricks.append((name, f"{host}:{path}", node.findtext("status", "0").strip() == "1"))
    return bricks


def parse_heal(xml_text: str) -> list[tuple[str, int, int]]:
    """`gluster volume heal VOL info summary --xml` -> ("host:/brick", entries to heal, entries in split-brain)."""
    root = ET.fromstring(xml_text)
    out = []
    for brick in root.iter("brick"):
        def number(tag: str, node: ET.Element = brick) -> int:
            text = (node.findtext(tag) or "0").strip()
            return int(text) if text.isdigit() else 0
        out.append((brick.findtext("name", ""), number("totalNumberOfEntries"), number("numberOfEntriesInSplitBrain")))
    return out


def _gluster(args: list[str], timeout: float) -> str | None:
    try:
        done = subprocess.run(["gluster", "--mode=script", *args, "--xml"], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        print(f"sd3_gluster_metrics: gluster {' '.join(args)} did not answer within {timeout:.0f} s", file=sys.stderr)
        return None
    if done.returncode != 0:
        print(f"sd3_gluster_metrics: gluster {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}",
              file=sys.stderr)
        return None
    return done.stdout


def collect(status_xml: str | None, heal_xml: dict[str, str | None], now: float) -> list[Family]:
    up = Family("sd3_gluster_up", "1 when glusterd answered `volume status`.")
    last_run = Family("sd3_gluster_collector_last_run_timestamp_seconds", "When the GlusterFS collector last ran.")
    last_run.add(now)
    bricks = parse_status(status_xml) if status_xml else []
    up.add(1 if status_xml else 0)
    online = Family("sd3_gluster_brick_online", "1 when the brick process runs, per volume and brick.")
    for volume, brick, is_online in bricks:
        online.add(1 if is_online else 0, volume=volume, brick=brick)
    pending = Family("sd3_gluster_heal_pending_entries", "Entries waiting for self-heal, per volume and brick.")
    split = Family("sd3_gluster_split_brain_entries", "Entries in split-brain, per volume and brick.")
    for volume, text in sorted(heal_xml.items()):
        for brick, entries, split_brain in parse_heal(text) if text else []:
            pending.add(entries, volume=volume, brick=brick)
            split.add(split_brain, volume=volume, brick=brick)
    return [up, last_run, online, pending, split]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--textfile-dir", type=Path, required=True, help="node_exporter's textfile directory")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds each gluster command may take")
    args = parser.parse_args(argv)
    status = _gluster(["volume", "status", "all"], args.timeout) if shutil.which("gluster") else None
    volumes = sorted({volume for volume, _, _ in parse_status(status)}) if status else []
    heal = {v: _gluster(["volume", "heal", v, "info", "summary"], args.timeout) for v in volumes}
    write_atomically(args.textfile_dir, "sd3_gluster.prom", render(collect(status, heal, time.time())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
