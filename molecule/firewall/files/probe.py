"""Tries each target once, all at the same time, and prints {target: "open" | "closed"} as JSON.

A target is HOST:PORT/tcp (open: the connection is accepted) or HOST:PORT/udp (open: an answer comes back to a
datagram). Refused, dropped (no answer within the timeout) and unreachable all read "closed"."""
import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

TIMEOUT = float(sys.argv[1])


def probe(target):
    address, protocol = target.rsplit("/", 1)
    host, port = address.rsplit(":", 1)
    kind = socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.settimeout(TIMEOUT)
        try:
            if protocol == "tcp":
                sock.connect((host, int(port)))
            else:
                sock.sendto(b"probe", (host, int(port)))
                sock.recvfrom(64)
        except OSError:
            return target, "closed"
    return target, "open"


with ThreadPoolExecutor(max_workers=32) as pool:
    print(json.dumps(dict(pool.map(probe, sys.argv[2:])), sort_keys=True))
