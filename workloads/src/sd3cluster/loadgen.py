"""Open-loop load for `sd3cluster serve` (or its balancer): requests at a fixed arrival rate, whatever the answers.

A closed loop (send, wait, send) slows down with the server and hides queueing; here request i leaves at
start + i / rate. Count and time are bounded by the caller; only the given URL is contacted.

    python -m sd3cluster.loadgen --url http://127.0.0.1:5000 --rate 2 --count 40 --body '{"prompt": "a cat"}'

prints one JSON summary: answers by code, latency percentiles of the successful ones, the slowest refusal.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_REQUESTS = 5000  # a bound on any one run: this is a test tool, not a traffic generator


@dataclass
class Answer:
    index: int
    sent: float  # seconds after the start
    code: int  # 0: no HTTP answer (connection refused or reset, timeout)
    seconds: float
    error: str = ""
    retry_after: str = ""


def post(url: str, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, bytes, dict[str, str]]:
    """One POST with its JSON body; (code, body, headers)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by the nearest-rank rule; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def open_loop(url: str, body: dict[str, Any], rate: float, count: int, timeout_s: float = 120.0,
              path: str = "/v1/images/generations", on_answer=None) -> list[Answer]:
    """`count` POSTs of `body`, request i sent at i / rate seconds; every answer (or failure) is returned.
    `on_answer(answer)` is called as answers come (a test can act mid-run)."""
    if not 0 < count <= MAX_REQUESTS:
        raise ValueError(f"count must be 1 to {MAX_REQUESTS}, got {count}")
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    start = time.monotonic()
    lock = threading.Lock()
    answers: list[Answer] = []

    def one(i: int) -> None:
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
        sent = time.monotonic()
        try:
            code, _, headers = post(url, path, body, timeout_s)
            answer = Answer(i, sent - start, code, time.monotonic() - sent, retry_after=headers.get("retry-after", ""))
        except OSError as e:  # refused, reset, timed out: counted, never raised
            answer = Answer(i, sent - start, 0, time.monotonic() - sent, error=f"{type(e).__name__}: {e}")
        with lock:
            answers.append(answer)
        if on_answer is not None:
            on_answer(answer)

    # One thread per request in flight: an open loop must not wait for a free thread to send.
    with ThreadPoolExecutor(max_workers=min(count, 512)) as pool:
        list(pool.map(one, range(count)))
    return sorted(answers, key=lambda a: a.index)


def summarize(answers: list[Answer], rate: float) -> dict[str, Any]:
    ok = [a.seconds for a in answers if a.code == 200]
    refused = [a.seconds for a in answers if a.code == 429]
    span = max((a.sent + a.seconds for a in answers), default=0.0)
    codes: dict[str, int] = {}
    for a in answers:
        codes[str(a.code)] = codes.get(str(a.code), 0) + 1
    return {"requests": len(answers), "rate": rate, "codes": codes,
            "ok": len(ok), "errors": sum(1 for a in answers if a.code not in (200, 429)),
            "p50_s": percentile(ok, 50), "p99_s": percentile(ok, 99), "max_s": max(ok, default=None),
            "p50_429_s": percentile(refused, 50), "slowest_429_s": max(refused, default=None), "span_s": span,
            "ok_per_s": len(ok) / span if span else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sd3cluster.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="base URL of a worker or the balancer")
    parser.add_argument("--rate", type=float, required=True, help="requests per second (open loop)")
    parser.add_argument("--count", type=int, required=True, help=f"requests in all (at most {MAX_REQUESTS})")
    parser.add_argument("--body", default='{"prompt": "a photo of a cat"}', help="JSON body of every request")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--answers", help="also write every answer as JSON lines to this file")
    args = parser.parse_args(argv)
    try:
        body = json.loads(args.body)
        answers = open_loop(args.url, body, args.rate, args.count, args.timeout)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"loadgen: error: {e}", file=sys.stderr)
        return 2
    if args.answers:
        with open(args.answers, "w") as f:
            f.writelines(json.dumps(asdict(a)) + "\n" for a in answers)
    print(json.dumps(summarize(answers, args.rate)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
