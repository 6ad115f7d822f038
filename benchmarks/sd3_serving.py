"""One `sd3cluster serve` worker under open-loop load, against offline `sd3cluster generate` on the same GPU.

Both run in processes of their own, one after the other, in one call (SD3-medium, random weights built in code,
1024x1024, 28 steps, guidance 7, both compiled):
1. offline: `sd3cluster generate --compile --batch-size B` over (1 + K) x B prompts; images/s from its per-image
   times, the first (compiling) batch left out;
2. the service: `sd3cluster serve --compile --max-batch B` (its warm-up compiles every batch size), then
   a. saturation: --saturation-requests single-image requests sent at 4/s, far above capacity; the images/s it
      completes (after the first answer, to leave out the pipeline filling) is the maximum sustainable rate;
   0. five lone requests one after the other: the latency of an idle worker;
   b. open loop at --load-fraction (0.75) of that rate for --requests requests: p50/p99 latency and errors.
Loopback only; every run is bounded in count and time.

    python3 benchmarks/sd3_serving.py --out serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sd3cluster.loadgen import open_loop, percentile, summarize

PROMPT = "a photo of a red house in the snow at night"


def _sd3cluster(*args: str) -> list[str]:
    return [sys.executable, "-m", "sd3cluster", *args]


def _model(args: argparse.Namespace) -> list[str]:
    return ["--preset", args.preset, "--device", args.device] + (["--compile"] if args.device == "cuda" else [])


def offline(args: argparse.Namespace, work: Path) -> dict:
    batch, batches, size, steps = args.batch, args.batches, args.size, args.steps
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(f"{PROMPT}, view {i}" for i in range((batches + 1) * batch)) + "\n")
    out = work / "offline"
    start = time.perf_counter()
    subprocess.run(_sd3cluster("generate", *_model(args), "--prompts", str(prompts), "--out", str(out),
                               "--size", str(size), "--steps", str(steps), "--batch-size", str(batch),
                               "--guidance", "7"),
                   check=True, timeout=900)
    wall = time.perf_counter() - start
    lines = [json.loads(x) for x in (out / ".parts" / "rank-0.jsonl").read_text().splitlines()]
    # Each line: one image, with its batch's seconds / batch size; the first batch compiled.
    steady = lines[batch:]
    seconds = sum(x["seconds"] for x in steady)
    return {"images": len(steady), "seconds": seconds, "images_per_s": len(steady) / seconds, "wall_s": wall,
            "batch": batch}


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"serve not ready after {timeout} s")


def serving(args: argparse.Namespace, work: Path) -> dict:
    port = 5000
    url = f"http://127.0.0.1:{port}"
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen(_sd3cluster("serve", *_model(args), "--port", str(port), "--max-batch", str(args.batch),
                                        "--set", f"serve.default_size={args.size}",
                                        "--set", f"serve.min_side={min(args.size, 256)}",
                                        "--set", f"serve.default_steps={args.steps}",
                                        "--set", "serve.queue_size=64", "--set", "serve.drain_grace_s=0"),
                            stdout=log, stderr=subprocess.STDOUT)
    body = {"prompt": PROMPT, "size": args.size, "steps": args.steps, "guidance": 7.0}
    try:
        ready_s = _wait_ready(url, proc, 600)
        # The latency of a lone request (an idle worker, batch 1): the floor of any percentile under load.
        idle = [open_loop(url, body, rate=1.0, count=1, timeout_s=300)[0] for _ in range(5)]
        idle_s = sorted(a.seconds for a in idle if a.code == 200)
        sat = open_loop(url, body, rate=4.0, count=args.saturation_requests, timeout_s=300)
        ok = sorted(a.sent + a.seconds for a in sat if a.code == 200)
        # Completions per second once the pipeline is busy: (images after the first) / (last - first answer).
        max_rate = (len(ok) - 1) / (ok[-1] - ok[0]) if len(ok) > 1 else 0.0
        rate = args.load_fraction * max_rate
        load = open_loop(url, body, rate=rate, count=args.requests, timeout_s=300)
        report = summarize(load, rate)
        ok_latency = [a.seconds for a in load if a.code == 200]
        report.update(p90_s=percentile(ok_latency, 90), mean_s=sum(ok_latency) / max(1, len(ok_latency)))
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    batch_lines = [x for x in metrics.splitlines() if x.startswith("sd3_serve_batch_size_") or
                   x.startswith("sd3_serve_stage_seconds_sum") or x.startswith("sd3_serve_stage_seconds_count")]
    return {"ready_s": ready_s, "idle_latency_s": idle_s, "saturation": summarize(sat, 4.0), "max_rate": max_rate,
            "load": report,
            "metrics": batch_lines, "serve_log_tail": (work / "serve.log").read_text().splitlines()[-8:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=4, help="max_batch of serve = generate's batch size")
    parser.add_argument("--batches", type=int, default=6, help="timed batches of the offline run")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--saturation-requests", type=int, default=28)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--load-fraction", type=float, default=0.75)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--preset", default="sd3-medium", help="tiny: a CPU rehearsal of this script")
    parser.add_argument("--device", default="cuda", help="cuda (compiled, as measured) or cpu")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result: dict = {"settings": vars(args) | {"out": str(args.out)}}
        if not args.skip_offline:
            result["offline"] = offline(args, work)
            print("offline:", json.dumps(result["offline"]), flush=True)
        result["serve"] = serving(args, work)
        load = result["serve"]["load"]
        if "offline" in result:
            result["served_over_offline"] = result["serve"]["max_rate"] / result["offline"]["images_per_s"]
        result["targets"] = {"p99_le_3s": (load["p99_s"] or 1e9) <= 3.0, "p50_le_1.6s": (load["p50_s"] or 1e9) <= 1.6,
                             "no_errors": load["errors"] == 0 and load["ok"] == load["requests"],
                             "batching_ge_0.9_offline": result.get("served_over_offline", 0) >= 0.9}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "serve"} | {
        "max_rate": result["serve"]["max_rate"], "load": load, "ready_s": result["serve"]["ready_s"],
        "idle_latency_s": result["serve"]["idle_latency_s"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
