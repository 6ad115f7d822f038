"""serve: a real uvicorn server on loopback with the tiny random pipeline. The API, limits that stop bad requests
before the queue, jobs and their cancel, dynamic batching, open-loop load below and above capacity (429 at once),
the deadline (504), and SIGTERM during load (not ready first, every accepted request finishes)."""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from sd3_helpers import run_env, sd3cluster
from sd3cluster.config import ServeConfig
from sd3cluster.loadgen import open_loop, percentile, post, summarize
from sd3cluster.serve import GenerationBody, LimitError, check_request

# Limits of the test servers: small images so the tiny model takes milliseconds; up to 256^2 and 500 steps so a
# request can be made slow on purpose.
LIMITS = ["--set", "serve.default_size=64", "--set", "serve.min_side=32", "--set", "serve.max_side=256",
          "--set", "serve.default_steps=4", "--set", "serve.max_steps=500", "--set", "serve.max_body_bytes=4096"]
SLOW = {"size": 256, "steps": 400, "n": 4}  # about 3 s on one core


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`sd3cluster serve` in a process of its own, on a free loopback port."""

    def __init__(self, *args: str, tmp_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "sd3cluster", "serve", "--preset", "tiny", "--device",
                                      "cpu", "--port", str(self.port), *LIMITS, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=run_env())

    def get(self, path: str, timeout: float = 10) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: dict | bytes, timeout: float = 60) -> tuple[int, dict, dict]:
        if isinstance(body, bytes):
            req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return r.status, json.loads(r.read()), dict(r.headers)
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read()), dict(e.headers)
        code, data, headers = post(self.url, path, body, timeout)
        return code, json.loads(data), headers

    def delete(self, path: str) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, method="DELETE")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_ready(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}:\n{self.log_path.read_text()}"
            try:
                if self.get("/readyz", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"not ready after {timeout} s:\n{self.log_path.read_text()}")

    def metric(self, name: str) -> float:
        """The value of one sample line of /metrics (0 when absent)."""
        for line in self.get("/metrics")[1].decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("served")
    s = Server("--output-dir", str(out), "--set", "serve.job_prefix=node1-cuda0",
               tmp_path=tmp_path_factory.mktemp("logs"))
    s.output_dir = out
    s.wait_ready()
    yield s
    s.stop()


def _png(item: dict) -> tuple[bytes, tuple[int, int]]:
    from PIL import Image

    data = base64.b64decode(item["b64_json"])
    with Image.open(io.BytesIO(data)) as img:
        return data, img.size


# -- limits, checked without a server ---------------------------------------------------------------------------
BAD_BODIES = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 2001}, "prompt"),
    ({"prompt": "a", "negative_prompt": "y" * 2001}, "negative_prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 5}, "n"),
    ({"prompt": "a", "steps": 0}, "steps"),
    ({"prompt": "a", "steps": 101}, "steps"),
    ({"prompt": "a", "guidance": -1}, "guidance"),
    ({"prompt": "a", "guidance": 31}, "guidance"),
    ({"prompt": "a", "width": 1000}, "width"),
    ({"prompt": "a", "height": 4096}, "height"),
    ({"prompt": "a", "size": "big"}, "size"),
    ({"prompt": "a", "size": 128}, "size"),
    ({"prompt": "a", "size": 1024, "width": 1024}, "size"),
    ({"prompt": "a", "seed": -1}, "seed"),
    ({"prompt": "a", "response_format": "path"}, "response_format"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_BODIES)])
def test_check_request_names_the_field_and_its_range(body: dict, field: str):
    with pytest.raises(LimitError) as info:
        check_request(GenerationBody(**body), ServeConfig())
    fields = [f for f, _ in info.value.problems]
    assert fields == [field], info.value.problems
    message = info.value.problems[0][1]
    assert any(ch.isdigit() for ch in message) or "either" in message or "b64_json" in message or "empty" in message


def test_check_request_defaults_and_pixel_budget():
    limits = ServeConfig(max_pixels=1024 * 768, default_size=768)
    spec = check_request(GenerationBody(prompt="a cat", size="1024x768", seed=5), limits)
    assert (spec.width, spec.height, spec.steps, spec.guidance, spec.seed) == (1024, 768, 28, 7.0, 5)
    assert check_request(GenerationBody(prompt="a"), limits).width == 768
    assert check_request(GenerationBody(prompt="a", width=512), limits).height == 512  # one side: square
    with pytest.raises(LimitError, match="pixels; allowed at most 786432"):
        check_request(GenerationBody(prompt="a", size=1024), limits)


# -- the running service -----------------------------------------------------------------------------------------
def test_same_seed_same_bytes_and_seeds_per_image(server: Server):
    code, first, _ = server.post("/v1/images/generations", {"prompt": "a red cat", "seed": 7, "n": 2})
    assert code == 200, first
    assert first["seed"] == 7 and [d["seed"] for d in first["data"]] == [7, 8]
    assert set(first["timings"]) >= {"text_encoding", "denoising", "vae", "png", "total"}
    code, again, _ = server.post("/v1/images/generations", {"prompt": "a red cat", "seed": 7, "n": 2})
    assert [d["b64_json"] for d in again["data"]] == [d["b64_json"] for d in first["data"]]
    data, size = _png(first["data"][0])
    assert size == (64, 64)
    assert _png(first["data"][1])[0] != data  # seed 8 is another image
    code, other, _ = server.post("/v1/images/generations", {"prompt": "a red cat", "seed": 9, "size": "96x32"})
    assert code == 200 and _png(other["data"][0])[1] == (96, 32)


def test_path_response_writes_the_png_on_the_volume(server: Server):
    code, answer, _ = server.post("/v1/images/generations", {"prompt": "a house", "response_format": "path"})
    assert code == 200, answer
    path = Path(answer["data"][0]["path"])
    assert path.is_file() and path.is_relative_to(server.output_dir)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Bad for the test servers' limits (sides 32 to 256, steps up to 500, 4 images, 2000 characters, 4096 bytes).
HTTP_BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 2001}, "prompt"),
    ({"prompt": "a", "negative_prompt": "y" * 2001}, "negative_prompt"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 5}, "n"),
    ({"prompt": "a", "steps": 0}, "steps"),
    ({"prompt": "a", "steps": 501}, "steps"),
    ({"prompt": "a", "guidance": -0.5}, "guidance"),
    ({"prompt": "a", "guidance": 31}, "guidance"),
    ({"prompt": "a", "width": 100}, "width"),
    ({"prompt": "a", "height": 272}, "height"),
    ({"prompt": "a", "size": "16x64"}, "size"),
    ({"prompt": "a", "size": "wide"}, "size"),
    ({"prompt": "a", "size": 64, "height": 64}, "size"),
    ({"prompt": "a", "seed": -3}, "seed"),
    ({"prompt": "a", "colour": "red"}, "colour"),  # unknown field
    ({"prompt": "a", "n": "two"}, "n"),  # wrong type
    ({"n": 1}, "prompt"),  # missing
    ({"prompt": "a", "response_format": "url"}, "response_format"),  # not one of the two
]


def test_bad_requests_get_422_naming_the_field_and_never_reach_the_model(server: Server):
    images = server.metric("sd3_serve_images_total")
    waits = server.metric("sd3_serve_queue_wait_seconds_count")
    answered = server.metric('sd3_serve_request_duration_seconds_count{route="/v1/images/generations"}')
    assert len(HTTP_BAD) >= 12
    for body, field in HTTP_BAD:
        code, answer, _ = server.post("/v1/images/generations", body)
        assert code == 422, (body, answer)
        named = [e["loc"][-1] for e in answer["detail"]]
        assert field in named, (body, answer)
    too_big = json.dumps({"prompt": "z" * 5000}).encode()
    code, answer, _ = server.post("/v1/images/generations", too_big)
    assert code == 422 and "4096" in answer["detail"][0]["msg"]
    code, answer, _ = server.post("/v1/jobs", {"prompt": "a", "steps": 501})
    assert code == 422 and answer["detail"][0]["loc"][-1] == "steps"
    assert server.metric("sd3_serve_images_total") == images
    assert server.metric("sd3_serve_queue_wait_seconds_count") == waits
    assert server.metric('sd3_serve_request_duration_seconds_count{route="/v1/images/generations"}') == answered
    assert server.metric('sd3_serve_requests_total{code="422",route="/v1/images/generations"}') >= len(HTTP_BAD)


def test_jobs_finish_and_a_cancelled_job_is_never_made(server: Server):
    code, slow, headers = server.post("/v1/jobs", {"prompt": "slow", **SLOW})
    assert code == 202 and slow["status"] == "queued" and headers["location"] == f"/v1/jobs/{slow['id']}"
    # The id names its worker (serve.job_prefix), so a balancer can route the job's GET/DELETE back to it.
    assert re.fullmatch(r"node1-cuda0-[0-9a-f]{32}", slow["id"]), slow["id"]
    # Another shape: it cannot join the slow batch, so it waits in the queue while that one runs.
    code, doomed, _ = server.post("/v1/jobs", {"prompt": "never", "size": 32, "n": 3})
    assert code == 202
    images_before = server.metric("sd3_serve_images_total")
    code, cancelled = server.delete(f"/v1/jobs/{doomed['id']}")
    assert code == 200 and cancelled["status"] == "cancelled"
    end = time.monotonic() + 120
    while time.monotonic() < end:
        state = json.loads(server.get(f"/v1/jobs/{slow['id']}")[1])
        if state["status"] not in ("queued", "running"):
            break
        time.sleep(0.2)
    assert state["status"] == "succeeded", state
    assert len(state["result"]["data"]) == 4 and _png(state["result"]["data"][0])[1] == (256, 256)
    time.sleep(0.5)  # the batcher would have started the cancelled job's batch by now
    assert server.metric("sd3_serve_images_total") == images_before + 4
    assert json.loads(server.get(f"/v1/jobs/{doomed['id']}")[1])["status"] == "cancelled"
    assert server.get("/v1/jobs/no-such-job")[0] == 404
    assert server.metric('sd3_serve_rejected_total{reason="cancelled"}') >= 1


def test_requests_of_one_shape_share_a_batch(server: Server):
    batches = server.metric("sd3_serve_batch_size_count")
    images = server.metric("sd3_serve_images_total")
    # Six single-image requests at once behind a slow one: they queue together and leave in batches of <= 4.
    assert server.post("/v1/jobs", {"prompt": "slow", **SLOW, "n": 1})[0] == 202
    answers = open_loop(server.url, {"prompt": "batch me", "seed": 1}, rate=200, count=6)
    assert [a.code for a in answers] == [200] * 6
    made_batches = server.metric("sd3_serve_batch_size_count") - batches - 1
    assert server.metric("sd3_serve_images_total") - images == 7
    assert made_batches <= 3, f"6 queued images of one shape took {made_batches} batches (max_batch 4)"
    for name in ("text_encoding", "denoising", "vae", "png"):
        assert server.metric(f'sd3_serve_stage_seconds_count{{stage="{name}"}}') > 0


def test_open_loop_below_and_above_capacity(tmp_path: Path):
    s = Server("--set", "serve.queue_size=6", "--set", "serve.max_batch=2", tmp_path=tmp_path)
    try:
        s.wait_ready()
        body = {"prompt": "load", "size": 128, "steps": 40}
        start = time.monotonic()
        for _ in range(3):
            assert s.post("/v1/images/generations", body)[0] == 200
        one = (time.monotonic() - start) / 3
        below = open_loop(s.url, body, rate=0.4 / one, count=12)
        report = summarize(below, 0.4 / one)
        print(f"\nbelow capacity (one image {one:.3f} s): {json.dumps(report)}")
        assert report["codes"] == {"200": 12}, report
        assert report["p50_s"] is not None and report["p99_s"] >= report["p50_s"]

        above = open_loop(s.url, body, rate=60, count=40)
        report = summarize(above, 60)
        print(f"above capacity: {json.dumps(report)}")
        assert set(report["codes"]) <= {"200", "429"}, report  # no request lost or failed
        assert report["codes"].get("429", 0) >= 10, report
        assert report["codes"]["200"] >= 6, report  # the accepted ones finished
        # Refused at once: 9 in 10 within 50 ms as the client sees it, none slower than 0.5 s (2 busy cores, the
        # load's own 40 threads and the server share them; a scheduling hiccup is not a queued refusal).
        refusals = [a.seconds for a in above if a.code == 429]
        assert percentile(refusals, 90) <= 0.05 and max(refusals) < 0.5, report
        assert all(a.retry_after.isdigit() and int(a.retry_after) >= 1 for a in above if a.code == 429)
    finally:
        assert s.stop() == 0


def test_deadline_answers_504_and_drops_the_work(tmp_path: Path):
    s = Server("--set", "serve.request_timeout_s=1", tmp_path=tmp_path)
    try:
        s.wait_ready()
        start = time.monotonic()
        code, answer, _ = s.post("/v1/images/generations", {"prompt": "slow", **SLOW})
        assert code == 504 and "request_timeout_s" in answer["detail"], answer
        assert time.monotonic() - start < 2.0  # answered at the deadline, not when the work would have ended
        assert s.metric('sd3_serve_rejected_total{reason="deadline"}') == 1
        assert s.metric("sd3_serve_images_total") == 0
        assert s.post("/v1/images/generations", {"prompt": "quick", "size": 32})[0] == 200
    finally:
        assert s.stop() == 0
    # Alone in its batch and past its deadline, the slow request was stopped between two denoising steps.
    assert "stopped: no requester left" in s.log_path.read_text()


def test_sigterm_during_load_finishes_every_accepted_request(tmp_path: Path):
    s = Server("--set", "serve.drain_grace_s=1", "--set", "serve.max_batch=2", tmp_path=tmp_path)
    s.wait_ready()
    events: list[tuple[float, str]] = []
    stop_polling = threading.Event()

    def poll_readyz() -> None:
        while not stop_polling.is_set():
            try:
                code = s.get("/readyz", timeout=2)[0]
                events.append((time.monotonic(), f"readyz {code}"))
            except OSError:
                events.append((time.monotonic(), "closed"))
                return
            time.sleep(0.02)

    poller = threading.Thread(target=poll_readyz, daemon=True)
    poller.start()
    sent_signal: list[float] = []

    def on_answer(answer) -> None:
        if answer.index == 3 and not sent_signal:
            sent_signal.append(time.monotonic())
            s.proc.send_signal(signal.SIGTERM)

    body = {"prompt": "drain", "size": 128, "steps": 60}
    answers = open_loop(s.url, body, rate=8, count=30, on_answer=on_answer)
    code = s.proc.wait(timeout=60)
    stop_polling.set()
    poller.join(timeout=5)
    s.log.close()
    log = s.log_path.read_text()
    assert code == 0, log
    accepted = [a for a in answers if a.code == 200]
    refused = [a for a in answers if a.code == 503]
    unreached = [a for a in answers if a.code == 0]
    # Every request got 200 (accepted and finished), 503 (refused while draining) or found no listener.
    assert len(accepted) + len(refused) + len(unreached) == len(answers), [(a.code, a.error) for a in answers]
    assert all("ConnectionRefused" in a.error for a in unreached), [a.error for a in unreached]
    assert len(accepted) >= 4 and refused, summarize(answers, 8)
    first_503 = next(t for t, e in events if e == "readyz 503")
    assert first_503 >= sent_signal[0]
    closed = [t for t, e in events if e == "closed"]
    assert not closed or closed[0] > first_503 + 0.9  # not ready for drain_grace_s before the listener closed
    assert "drained; exiting" in log


def test_cli_errors_are_one_line_before_the_model_loads(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        result = sd3cluster("serve", "--preset", "tiny", "--device", "cpu", "--port", str(taken.getsockname()[1]))
    assert result.returncode == 2 and "cannot listen on 127.0.0.1" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for args, text in ((["--output-dir", str(a_file)], "is a file"),
                       (["--pretrained", str(tmp_path / "none")], "does not exist"),
                       (["--set", "serve.default_size=100"], "multiple of 16"),
                       (["--set", "serve.default_steps=200"], "exceeds max_steps"),
                       (["--device", "cuda"], "--device cuda (serve.device)"),
                       (["--port", "0"], "serve.port")):
        result = sd3cluster("serve", "--preset", "tiny", "--port", str(_free_port()), *args)
        assert result.returncode == 2 and text in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
