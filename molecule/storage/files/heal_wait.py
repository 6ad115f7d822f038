#!/usr/bin/env python3
"""Waits until every brick of a volume is connected and `gluster volume heal VOL info` lists no
entries, asking for an index heal while entries remain. Prints JSON with the seconds since SINCE
(epoch seconds: when the stopped node was started again) and the entries seen at the start.

Usage: heal_wait.py VOLUME SINCE TIMEOUT
"""
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HEAL_KICK_EVERY_S = 10


def heal_info(volume):
    out = subprocess.run(["gluster", "--mode=script", "volume", "heal", volume, "info", "--xml"],
                         capture_output=True, text=True, check=False).stdout
    try:
        root = ET.fromstring(out)
    except ET.ParseError:
        return None
    bricks = []
    for brick in root.iter("brick"):
        entries = brick.findtext("numberOfEntries", "-").strip()
        bricks.append({"name": brick.findtext("name", "").strip(), "status": brick.findtext("status", "").strip(),
                       "entries": int(entries) if entries.isdigit() else None})
    return bricks


def main():
    volume, since, timeout = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    deadline, last_kick, first = time.time() + timeout, 0.0, None
    while time.time() < deadline:
        bricks = heal_info(volume) or []
        connected = bool(bricks) and all(b["status"] == "Connected" and b["entries"] is not None for b in bricks)
        pending = sum(b["entries"] or 0 for b in bricks) if connected else None
        if connected and first is None:
            first = pending
        if connected and pending == 0:
            json.dump({"healed": True, "heal_seconds": round(time.time() - since, 1), "entries_at_reconnect": first,
                       "bricks": bricks}, sys.stdout)
            return 0
        if connected and time.time() - last_kick > HEAL_KICK_EVERY_S:
            subprocess.run(["gluster", "--mode=script", "volume", "heal", volume], capture_output=True, check=False)
            last_kick = time.time()
        time.sleep(1)
    json.dump({"healed": False, "heal_seconds": round(time.time() - since, 1), "bricks": heal_info(volume)}, sys.stdout)
    return 1


if __name__ == "__main__":
    sys.exit(main())
