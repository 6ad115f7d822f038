#!/usr/bin/env python3
"""Checks every file of a manifest (sha256sum format) in a directory: a brick or the mount.
Prints JSON: checked (intact), missing, corrupt, found_after_listing, and the names of the first few missing or
corrupt files, a missing one with the error its lookup gave. Reads only.

A file whose lookup by name fails is looked up again after a listing of the directory: GlusterFS users report
clients that miss a file by name around a rebalance while a listing shows it. Such a file counts as checked when
intact, and in found_after_listing, so the caller can report it. A file found but not readable counts as missing.

Usage: check_files.py MANIFEST DIRECTORY
"""
import errno
import hashlib
import json
import os
import sys


def error_name(error):
    """ENOENT, ESTALE, EIO, ...: what an OSError was."""
    return errno.errorcode.get(error.errno, str(error.errno))


def lookup_error(path):
    """None when the path's lookup succeeds, else the error's name."""
    try:
        os.stat(path)
    except OSError as error:
        return error_name(error)
    return None


def main():
    manifest, directory = sys.argv[1], sys.argv[2]
    with open(manifest, encoding="ascii") as lines:
        entries = [line.split() for line in lines if line.strip()]
    failed_lookups = {name: lookup_error(os.path.join(directory, name)) for _, name in entries}
    failed_lookups = {name: error for name, error in failed_lookups.items() if error}
    if failed_lookups:
        os.listdir(directory)
    checked, found_after_listing, missing, corrupt = 0, 0, [], []
    for digest, name in entries:
        path = os.path.join(directory, name)
        if name in failed_lookups:
            if lookup_error(path):
                missing.append(f"{name} ({failed_lookups[name]})")
                continue
            found_after_listing += 1
        try:
            with open(path, "rb") as data:
                content = data.read()
        except OSError as error:  # found, then gone or unreadable while read (a file moving between bricks)
            missing.append(f"{name} (read: {error_name(error)})")
            continue
        if hashlib.sha256(content).hexdigest() != digest:
            corrupt.append(name)
            continue
        checked += 1
    json.dump({"directory": directory, "checked": checked, "missing": len(missing), "corrupt": len(corrupt),
               "found_after_listing": found_after_listing, "examples": (missing + corrupt)[:5]}, sys.stdout)


if __name__ == "__main__":
    main()
