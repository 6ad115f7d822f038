#!/usr/bin/env python3
"""Checks every file of a manifest (sha256sum format) in a directory: a brick or the mount.
Prints JSON: checked, missing, corrupt (names of the first few of each, a missing file with the error its
stat gave, so a lookup failure of the mount shows apart from a file that is gone). Reads only.

Usage: check_files.py MANIFEST DIRECTORY
"""
import errno
import hashlib
import json
import os
import sys


def main():
    manifest, directory = sys.argv[1], sys.argv[2]
    checked, missing, corrupt = 0, [], []
    with open(manifest, encoding="ascii") as lines:
        for line in lines:
            digest, name = line.split()
            path = os.path.join(directory, name)
            try:
                os.stat(path)
            except OSError as error:
                missing.append(f"{name} ({errno.errorcode.get(error.errno, error.errno)})")
                continue
            with open(path, "rb") as data:
                if hashlib.sha256(data.read()).hexdigest() != digest:
                    corrupt.append(name)
                    continue
            checked += 1
    json.dump({"directory": directory, "checked": checked, "missing": len(missing), "corrupt": len(corrupt),
               "examples": (missing + corrupt)[:5]}, sys.stdout)


if __name__ == "__main__":
    main()
