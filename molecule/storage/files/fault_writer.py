#!/usr/bin/env python3
"""Writes COUNT files of random bytes through the GlusterFS mount, one at a time, each fsync'ed, and
records its SHA-256 in a manifest on the local disk. A write that fails is retried (never skipped)
until it succeeds or the deadline passes. Prints a JSON summary.

Usage: fault_writer.py DIR MANIFEST PROGRESS --count N --pace SECONDS
"""
import argparse
import hashlib
import json
import os
import sys
import time

RETRY_DEADLINE_S = 120


def write_one(path, data):
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("manifest")
    parser.add_argument("progress")
    parser.add_argument("--count", type=int, default=600)
    parser.add_argument("--pace", type=float, default=0.03)
    args = parser.parse_args()
    os.makedirs(args.directory, exist_ok=True)
    retries, started = 0, time.monotonic()
    with open(args.manifest, "w", encoding="ascii") as manifest:
        for index in range(args.count):
            name = f"file-{index:05d}.bin"
            data = os.urandom(4096 + (index * 7919) % 61440)
            deadline = time.monotonic() + RETRY_DEADLINE_S
            while True:
                try:
                    write_one(os.path.join(args.directory, name), data)
                    break
                except OSError as err:
                    retries += 1
                    if time.monotonic() > deadline:
                        print(json.dumps({"error": f"{name}: {err}", "written": index}))
                        return 1
                    time.sleep(0.5)
            manifest.write(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
            manifest.flush()
            with open(args.progress, "w", encoding="ascii") as progress:
                progress.write(str(index + 1))
            time.sleep(args.pace)
    print(json.dumps({"written": args.count, "retries": retries, "seconds": round(time.monotonic() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
