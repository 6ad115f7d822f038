"""`sd3cluster serve`: the SD3 pipeline behind HTTP, one process per GPU.

Requests are checked against the configured limits before they are queued (422 names the field and the allowed
range). Accepted images wait in one bounded queue (full: 429 with Retry-After at once); a batcher takes the
oldest image and up to `max_batch - 1` others of the same size, steps and guidance that arrive within
`max_wait_ms`, and runs them as one batch in a worker thread, so the event loop keeps answering health checks
and admissions while the GPU works. A request past its deadline answers 504, a cancelled job or a client that
went away stops waiting, and their images are taken out of the queue; a running batch whose every image lost its
requester stops between two denoising steps. SIGTERM makes /readyz answer 503, refuses new work with 503 (a
balancer retries elsewhere), finishes every accepted request, then exits 0.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import secrets
import socket
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from .config import Config, ServeConfig
from .errors import UserError

ROUTES = ("/v1/images/generations", "/v1/jobs", "/v1/jobs/{id}", "/healthz", "/readyz", "/metrics")
STAGES = ("text_encoding", "denoising", "vae", "png")
MAX_SEED = 2**63 - 1


# -- requests and their limits ---------------------------------------------------------------------------------
class GenerationBody(BaseModel):
    """The body of POST /v1/images/generations and /v1/jobs (field names as in OpenAI's images API)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    negative_prompt: str = ""
    n: int = 1
    size: str | int | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None
    response_format: Literal["b64_json", "path"] = "b64_json"


@dataclass(frozen=True)
class Spec:
    """One validated request: everything the batcher needs."""

    prompt: str
    negative_prompt: str
    n: int
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    response_format: str

    @property
    def batch_key(self) -> tuple[int, int, int, float]:
        """Images that can share a forward pass: same shape, same number of steps, same guidance."""
        return (self.width, self.height, self.steps, self.guidance)


class LimitError(Exception):
    """A request outside the service's limits; `problems` are (field, message) pairs, answered as 422."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))
        self.problems = problems

    def detail(self) -> list[dict[str, Any]]:
        return [{"loc": ["body", f], "msg": m, "type": "value_error"} for f, m in self.problems]


def _parse_size(size: str | int) -> tuple[int, int] | None:
    if isinstance(size, int):
        return size, size
    width, sep, height = size.lower().strip().partition("x")
    try:
        return (int(width), int(height)) if sep else (int(width), int(width))
    except ValueError:
        return None


def check_request(body: GenerationBody, limits: ServeConfig, seed_source: Callable[[], int] | None = None) -> Spec:
    """The request's Spec, or LimitError naming every field outside its allowed range (nothing is queued)."""
    problems: list[tuple[str, str]] = []

    def bad(name: str, message: str) -> None:
        problems.append((name, message))

    if not body.prompt.strip():
        bad("prompt", "must not be empty")
    for name in ("prompt", "negative_prompt"):
        if len(getattr(body, name)) > limits.max_prompt_chars:
            bad(name, f"is {len(getattr(body, name))} characters; allowed at most {limits.max_prompt_chars}")
    if not 1 <= body.n <= limits.max_n:
        bad("n", f"is {body.n}; allowed 1 to {limits.max_n}")
    steps = limits.default_steps if body.steps is None else body.steps
    if not 1 <= steps <= limits.max_steps:
        bad("steps", f"is {steps}; allowed 1 to {limits.max_steps}")
    guidance = limits.default_guidance if body.guidance is None else body.guidance
    if not (math.isfinite(guidance) and 0 <= guidance <= limits.max_guidance):
        bad("guidance", f"is {guidance}; allowed 0 to {limits.max_guidance}")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED - limits.max_n:
        bad("seed", f"is {body.seed}; allowed 0 to {MAX_SEED - limits.max_n}")
    if body.response_format == "path" and limits.output_dir is None:
        bad("response_format", "'path' needs the service's serve.output_dir; this one has none: ask for b64_json")

    # (field that names it in an error, side, value); a side taken from the other one is not checked twice.
    width = height = limits.default_size
    sides: list[tuple[str, str, int]] = []
    if body.size is not None:
        if body.width is not None or body.height is not None:
            bad("size", "give either size or width/height, not both")
        parsed = _parse_size(body.size)
        if parsed is None:
            bad("size", f"is {body.size!r}; write N or WIDTHxHEIGHT, e.g. 1024 or 1024x768")
        else:
            width, height = parsed
            square = isinstance(body.size, int) or "x" not in body.size.lower()
            sides = [("size", "side", width)] if square else [("size", "width", width), ("size", "height", height)]
    else:
        width = body.width if body.width is not None else (body.height or limits.default_size)
        height = body.height if body.height is not None else (body.width or limits.default_size)
        sides = [(name, name, value) for name, value in (("width", body.width), ("height", body.height))
                 if value is not None]
    for field_name, side, value in sides:
        if not limits.min_side <= value <= limits.max_side or value % 16:
            bad(field_name, f"{side} is {value}; allowed multiples of 16 from {limits.min_side} to {limits.max_side}")
    if not problems and width * height > limits.max_pixels:
        bad(sides[0][0] if sides else "size",
            f"{width}x{height} is {width * height} pixels; allowed at most {limits.max_pixels}")
    if problems:
        raise LimitError(problems)
    seed = body.seed if body.seed is not None else (seed_source or (lambda: secrets.randbelow(2**31)))()
    return Spec(body.prompt, body.negative_prompt, body.n, width, height, steps, float(guidance), seed,
                body.response_format)


# -- accepted work ---------------------------------------------------------------------------------------------
@dataclass
class Ticket:
    """One accepted request (a synchronous one or a job) and the state of its images."""

    id: str
    spec: Spec
    arrived: float  # time.monotonic()
    deadline: float
    future: asyncio.Future
    results: list[dict[str, Any] | None] = field(default_factory=list)
    status: str = "queued"  # queued | running | succeeded | failed | cancelled
    error: str = ""
    finished_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def abandoned(self) -> bool:
        """Nobody will read this ticket's images any more (cancelled, timed out, client gone)."""
        return self.status in ("cancelled", "failed") or time.monotonic() > self.deadline

    def public(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"id": self.id, "status": self.status, "seed": self.spec.seed}
        if self.status == "succeeded":
            answer["result"] = response_body(self)
        if self.error:
            answer["error"] = self.error
        return answer


@dataclass
class Slot:
    """One image of a ticket, waiting in the queue."""

    ticket: Ticket
    index: int
    queued_at: float

    @property
    def seed(self) -> int:
        return self.ticket.spec.seed + self.index


def response_body(ticket: Ticket) -> dict[str, Any]:
    return {"created": int(time.time()), "id": ticket.id, "seed": ticket.spec.seed,
            "data": list(ticket.results), "timings": {k: round(v, 4) for k, v in ticket.timings.items()}}


class Metrics:
    """The service's Prometheus metrics, in a registry of its own (several services can live in one process)."""

    def __init__(self, device_is_cuda: bool):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # the *_created series double the scrape and no rule reads them
        self.registry = CollectorRegistry()
        latency = (0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 8, 13, 20, 30, 60, 120, 300)
        r = self.registry
        self.requests = Counter("sd3_serve_requests", "HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.duration = Histogram("sd3_serve_request_duration_seconds", "Latency of answered (2xx) requests",
                                  ["route"], buckets=latency, registry=r)
        self.queue_depth = Gauge("sd3_serve_queue_depth", "Images accepted and not yet started", registry=r)
        self.queue_capacity = Gauge("sd3_serve_queue_capacity", "Images the queue holds at most", registry=r)
        self.queue_wait = Histogram("sd3_serve_queue_wait_seconds", "Arrival to the start of an image's batch",
                                    buckets=latency, registry=r)
        self.stage = Histogram("sd3_serve_stage_seconds", "Seconds per batch of each stage", ["stage"],
                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
                               registry=r)
        self.batch_size = Histogram("sd3_serve_batch_size", "Images per forward pass",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), registry=r)
        self.images = Counter("sd3_serve_images", "Images made", registry=r)
        self.ready = Gauge("sd3_serve_ready", "1 when the worker takes requests", registry=r)
        self.rejected = Counter("sd3_serve_rejected", "Requests refused or dropped by reason", ["reason"], registry=r)
        for reason in ("queue_full", "deadline", "cancelled", "draining", "not_ready"):
            self.rejected.labels(reason)
        for stage in STAGES:
            self.stage.labels(stage)
        if device_is_cuda:
            import torch

            memory = Gauge("sd3_serve_gpu_memory_bytes", "GPU memory of this worker", ["kind"], registry=r)
            memory.labels("allocated").set_function(torch.cuda.memory_allocated)
            memory.labels("reserved").set_function(torch.cuda.memory_reserved)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def route_label(path: str) -> str:
    """A bounded label for a request path (job ids and unknown paths must not become label values)."""
    if path.startswith("/v1/jobs/"):
        return "/v1/jobs/{id}"
    return path if path in ROUTES else "other"


# -- the engine: queue, batcher, worker thread -------------------------------------------------------------------
class Engine:
    """Owns the pipeline, the queue of image slots, the batcher and the drain. Runs on the server's event loop;
    the pipeline runs in one worker thread."""

    def __init__(self, cfg: Config, pipeline_factory: Callable[[], Any], log: Callable[[str], None] = print):
        self.cfg, self.s = cfg, cfg.serve
        self.pipeline_factory = pipeline_factory
        self.log = log
        self.pipe: Any = None
        self.state = "loading"  # loading | warming up | ready | draining | failed
        self.queue: deque[Slot] = deque()
        self.tickets: dict[str, Ticket] = {}  # every unfinished ticket and finished jobs (until job_ttl_s)
        self.jobs: set[str] = set()
        self.running = 0
        self.batch_seconds_per_image = 0.0  # running mean, for Retry-After
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sd3-pipeline")
        # PNG compression (zlib, outside the GIL) of one batch overlaps the next batch's GPU work.
        self.png_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sd3-png")
        self.png_tasks: set[asyncio.Task] = set()
        self.changed: asyncio.Event | None = None
        self.drain_requested = threading.Event()
        self.stop_server: Callable[[], None] = lambda: None
        self.exit_code = 0
        self.metrics: Metrics | None = None
        self.tasks: list[asyncio.Task] = []

    # lifecycle
    async def start(self) -> None:
        self.changed = asyncio.Event()
        self.tasks = [asyncio.create_task(self._load_then_batch()), asyncio.create_task(self._watch_drain())]

    async def _load_then_batch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.pipe = await loop.run_in_executor(self.executor, self.pipeline_factory)
            if self.metrics is None:
                self.metrics = Metrics(self.pipe.device.type == "cuda")
                self.metrics.queue_capacity.set(self.s.queue_size)
            if self.s.warmup:
                self.state = "warming up"
                seconds = await loop.run_in_executor(self.executor, self._warmup)
                self.log(f"[serve] warm-up: batches of 1 to {self.s.max_batch} at {self.s.default_size}x"
                         f"{self.s.default_size} in {seconds:.1f} s")
        except Exception as e:  # the worker cannot serve: say why and exit non-zero (systemd restarts it)
            self.state = "failed"
            self.exit_code = 1
            self.log(f"[serve] error: the pipeline could not be loaded or warmed up: {e}")
            self.stop_server()
            return
        if not self.drain_requested.is_set():
            self.state = "ready"
            self.metrics.ready.set(1)
            self.log(f"[serve] ready on http://{self.s.host}:{self.s.port}")
        await self._batch_forever()

    def _warmup(self) -> float:
        """The default request, then every batch size up to max_batch at the default size: with compile, each
        batch size's graphs are built here rather than in a user's request (2 steps suffice for that)."""
        start = time.perf_counter()
        side = self.s.default_size
        for batch in range(1, self.s.max_batch + 1):
            steps = self.s.default_steps if batch == 1 else min(2, self.s.default_steps)
            self.pipe(["warm-up"] * batch, list(range(batch)), side, side, steps, self.s.default_guidance,
                      [""] * batch)
        return time.perf_counter() - start

    async def _watch_drain(self) -> None:
        """SIGTERM (via drain_requested): not ready, refuse new work, finish what was accepted, then stop."""
        while not self.drain_requested.is_set():
            await asyncio.sleep(0.05)
        started = time.monotonic()
        if self.state != "failed":
            self.state = "draining"
        if self.metrics:
            self.metrics.ready.set(0)
        self.log(f"[serve] SIGTERM: draining {len(self.queue)} queued image(s) and {self._unfinished()} request(s)")
        while time.monotonic() - started < self.s.drain_timeout_s:
            idle = not self.queue and self.running == 0 and self._unfinished() == 0
            if idle and time.monotonic() - started >= self.s.drain_grace_s:
                break
            await asyncio.sleep(0.05)
        else:
            self.log(f"[serve] drain_timeout_s {self.s.drain_timeout_s} passed with {self._unfinished()} request(s) "
                     "unfinished; exiting")
        self.log("[serve] drained; exiting")
        self.stop_server()

    def _unfinished(self) -> int:
        return sum(1 for t in self.tickets.values() if t.status in ("queued", "running"))

    # admission
    def admit(self, spec: Spec, job: bool) -> Ticket:
        """Queue the spec's images, or raise Refused (503 not ready/draining, 429 queue full) at once."""
        if self.state != "ready":
            reason = "draining" if self.state == "draining" else "not_ready"
            self._count_rejection(reason)
            raise Refused(503, f"the worker is {self.state}; retry on another worker", retry_after=5)
        if len(self.queue) + spec.n > self.s.queue_size:
            self._count_rejection("queue_full")
            raise Refused(429, f"the queue is full ({len(self.queue)} of {self.s.queue_size} images waiting)",
                          retry_after=self._retry_after())
        now = time.monotonic()
        job_id = f"{self.s.job_prefix}-{uuid.uuid4().hex}" if self.s.job_prefix else uuid.uuid4().hex
        ticket = Ticket(job_id, spec, now, now + self.s.request_timeout_s,
                        asyncio.get_running_loop().create_future(), [None] * spec.n)
        self.tickets[ticket.id] = ticket
        if job:
            self.jobs.add(ticket.id)
        self.queue.extend(Slot(ticket, i, now) for i in range(spec.n))
        self._queue_changed()
        return ticket

    def _retry_after(self) -> int:
        """Seconds until the queue has room again, from the measured time per image (at least 1)."""
        per_image = self.batch_seconds_per_image or 1.0
        return max(1, math.ceil(len(self.queue) * per_image))

    def _count_rejection(self, reason: str) -> None:
        if self.metrics:
            self.metrics.rejected.labels(reason).inc()

    def _queue_changed(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.queue))
        if self.changed is not None:
            self.changed.set()

    def abandon(self, ticket: Ticket, status: str, reason: str) -> None:
        """Stop work for a ticket nobody waits for: its queued images leave the queue now."""
        if ticket.status not in ("queued", "running"):
            return
        ticket.status = status
        ticket.error = reason
        ticket.finished_at = time.monotonic()
        self.queue = deque(s for s in self.queue if s.ticket is not ticket)
        self._count_rejection("cancelled" if status == "cancelled" else "deadline")
        if not ticket.future.done():
            ticket.future.set_exception(Refused(504 if status == "failed" else 499, reason))
            ticket.future.exception()  # retrieved: a job's future may have no reader
        self._queue_changed()
        if ticket.id not in self.jobs:
            self.tickets.pop(ticket.id, None)

    def expire_jobs(self) -> None:
        now = time.monotonic()
        for job_id in list(self.jobs):
            ticket = self.tickets.get(job_id)
            if ticket is None:
                self.jobs.discard(job_id)
            elif ticket.status in ("queued", "running") and now > ticket.deadline:
                self.abandon(ticket, "failed", f"deadline of {self.s.request_timeout_s:g} s passed")
            elif ticket.finished_at is not None and now - ticket.finished_at > self.s.job_ttl_s:
                self.tickets.pop(job_id, None)
                self.jobs.discard(job_id)

    # batching
    def _take_batch(self) -> list[Slot]:
        """The oldest live image and up to max_batch - 1 more of the same batch key, in arrival order."""
        for ticket in {s.ticket.id: s.ticket for s in self.queue if s.ticket.abandoned}.values():
            self.abandon(ticket, "failed", f"deadline of {self.s.request_timeout_s:g} s passed")
        if not self.queue:
            return []
        key = self.queue[0].ticket.spec.batch_key
        batch = [s for s in self.queue if s.ticket.spec.batch_key == key][: self.s.max_batch]
        taken = set(map(id, batch))
        self.queue = deque(s for s in self.queue if id(s) not in taken)
        self._queue_changed()
        return batch

    def _same_key_waiting(self) -> int:
        key = self.queue[0].ticket.spec.batch_key
        return sum(1 for s in self.queue if s.ticket.spec.batch_key == key)

    async def _batch_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.changed.clear()
            if not self.queue:
                await self.changed.wait()
                continue
            # The batching window: the oldest image waits at most max_wait_ms for company.
            window_end = self.queue[0].queued_at + self.s.max_wait_ms / 1000
            while self.queue and self._same_key_waiting() < self.s.max_batch and time.monotonic() < window_end:
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.0, window_end - time.monotonic()))
                except TimeoutError:
                    break
            batch = self._take_batch()
            if not batch:
                continue
            started = time.monotonic()
            for slot in batch:
                slot.ticket.status = "running" if slot.ticket.status == "queued" else slot.ticket.status
                if self.metrics:
                    self.metrics.queue_wait.observe(started - slot.ticket.arrived)
            self.running = len(batch)
            try:
                outcome = await loop.run_in_executor(self.executor, self._run_batch, batch)
            except Exception as e:  # a failed batch fails its requests, not the worker
                outcome = e
            finally:
                self.running = 0
            self._deliver(batch, outcome, time.monotonic() - started)

    def _run_batch(self, batch: list[Slot]) -> dict[str, Any] | None:
        """In the pipeline thread: text encoding, denoising and VAE decode of one batch (None: stopped because
        nobody waits for any of its images). PNG encoding happens elsewhere, so the GPU goes on to the next batch."""
        from .pipeline import Stopped

        spec = batch[0].ticket.spec
        pipe = self.pipe
        times: dict[str, float] = {}
        start = time.perf_counter()
        guided = spec.guidance > 1.0
        cond = pipe.encode([s.ticket.spec.prompt for s in batch],
                           [s.ticket.spec.negative_prompt for s in batch] if guided else None)
        pipe._sync()
        times["text_encoding"] = time.perf_counter() - start
        start = time.perf_counter()
        noise = pipe.initial_noise([s.seed for s in batch], spec.height, spec.width)
        try:
            latents = pipe.denoise(noise, cond, spec.steps, spec.guidance,
                                   should_stop=lambda: all(s.ticket.abandoned for s in batch))
        except Stopped:
            return None
        pipe._sync()
        times["denoising"] = time.perf_counter() - start
        start = time.perf_counter()
        images = pipe.decode(latents)
        times["vae"] = time.perf_counter() - start
        return {"images": images, "times": times}

    def _encode_image(self, slot: Slot, image: Any) -> dict[str, Any]:
        """In a PNG thread: one image as PNG (its settings in a text chunk), in the answer or on the volume."""
        from .generate import png_bytes, write_file_atomic

        t = slot.ticket
        record = {"prompt": t.spec.prompt, "negative_prompt": t.spec.negative_prompt, "seed": slot.seed,
                  "steps": t.spec.steps, "guidance": t.spec.guidance, "width": t.spec.width,
                  "height": t.spec.height, "model": self.pipe.description}
        data = png_bytes(image, record, self.s.png_compress_level)
        if t.spec.response_format == "path":
            folder = Path(self.s.output_dir) / time.strftime("%Y-%m-%d", time.gmtime())
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{t.id}-{slot.index}.png"
            write_file_atomic(data, path)
            return {"path": str(path), "seed": slot.seed}
        return {"b64_json": base64.b64encode(data).decode("ascii"), "seed": slot.seed}

    def _fail(self, tickets: list[Ticket], error: str) -> None:
        for ticket in tickets:
            if ticket.status in ("queued", "running"):
                ticket.status, ticket.error = "failed", error
                ticket.finished_at = time.monotonic()
                if not ticket.future.done():
                    ticket.future.set_exception(Refused(500, error))
                    ticket.future.exception()
                if ticket.id not in self.jobs:
                    self.tickets.pop(ticket.id, None)

    def _deliver(self, batch: list[Slot], outcome: dict[str, Any] | Exception | None, seconds: float) -> None:
        tickets = list({s.ticket.id: s.ticket for s in batch}.values())
        if outcome is None:  # stopped: every requester of the batch had gone
            self.log(f"[serve] batch of {len(batch)} stopped: no requester left")
            return
        if isinstance(outcome, Exception):
            self.log(f"[serve] batch of {len(batch)} failed: {type(outcome).__name__}: {outcome}")
            self._fail(tickets, f"generation failed: {outcome}")
            return
        n = len(batch)
        self.batch_seconds_per_image = (0.8 * self.batch_seconds_per_image + 0.2 * seconds / n
                                        if self.batch_seconds_per_image else seconds / n)
        if self.metrics:
            self.metrics.batch_size.observe(n)
            self.metrics.images.inc(n)
            for stage, value in outcome["times"].items():
                self.metrics.stage.labels(stage).observe(value)
        task = asyncio.create_task(self._encode_batch(batch, outcome["images"], outcome["times"]))
        self.png_tasks.add(task)
        task.add_done_callback(self.png_tasks.discard)

    async def _encode_batch(self, batch: list[Slot], images: Any, times: dict[str, float]) -> None:
        """PNGs of a finished batch in the PNG threads; each request answers once all its images are encoded."""
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        live = [(slot, image) for slot, image in zip(batch, images, strict=True) if slot.ticket.status == "running"]
        try:
            results = await asyncio.gather(*(loop.run_in_executor(self.png_executor, self._encode_image, slot, image)
                                             for slot, image in live))
        except Exception as e:  # a full volume, say: the requests fail with the reason, the worker goes on
            self.log(f"[serve] PNG of a batch failed: {type(e).__name__}: {e}")
            self._fail([slot.ticket for slot, _ in live], f"writing the image failed: {e}")
            return
        times = {**times, "png": time.perf_counter() - start}
        if self.metrics:
            self.metrics.stage.labels("png").observe(times["png"])
        for (slot, _), result in zip(live, results, strict=True):
            t = slot.ticket
            if t.status != "running":  # abandoned while its images were made: dropped
                continue
            t.results[slot.index] = result
            for stage, value in times.items():
                t.timings[stage] = t.timings.get(stage, 0.0) + value
            if all(r is not None for r in t.results):
                t.status = "succeeded"
                t.finished_at = time.monotonic()
                t.timings["total"] = t.finished_at - t.arrived
                if not t.future.done():
                    t.future.set_result(t)
                if t.id not in self.jobs:
                    self.tickets.pop(t.id, None)


class Refused(Exception):
    """An answer other than 200 for a request: HTTP code, message, optional Retry-After seconds."""

    def __init__(self, code: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after = code, message, retry_after


# -- the HTTP application ----------------------------------------------------------------------------------------
class BodyLimit:
    """ASGI middleware: a request body over max_body_bytes is answered 422 before it is parsed, whether its length
    is announced or not; it also counts every answer by route and code."""

    def __init__(self, app: Any, engine: Engine):
        self.app, self.engine = app, engine

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        started = time.monotonic()
        code_seen: list[int] = []

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                code_seen.append(message["status"])
            await send(message)

        limit = self.engine.s.max_body_bytes
        headers = dict(scope.get("headers") or [])
        announced = headers.get(b"content-length")
        too_big = announced is not None and announced.isdigit() and int(announced) > limit
        replay = receive
        if not too_big and scope["method"] in ("POST", "PUT", "PATCH"):
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > limit:
                    too_big = True
                    break
            body = b"".join(chunks)
            sent = False

            async def replay() -> dict:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()
        if too_big:
            payload = json.dumps({"detail": [{"loc": ["body"], "type": "value_error",
                                              "msg": f"request body is larger than {limit} bytes; allowed at most "
                                                     f"{limit} (serve.max_body_bytes)"}]}).encode()
            await counting_send({"type": "http.response.start", "status": 422,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
        else:
            await self.app(scope, replay, counting_send)
        metrics = self.engine.metrics
        if metrics is not None and code_seen:
            metrics.requests.labels(route, str(code_seen[0])).inc()
            # Latency of work done: refusals (429 in a millisecond) would make a p99 alert look better than it is.
            if route not in ("/metrics", "/healthz", "/readyz") and code_seen[0] < 400:
                metrics.duration.labels(route).observe(time.monotonic() - started)


def build_app(engine: Engine):
    """The FastAPI application of one worker."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    @asynccontextmanager
    async def lifespan(_app):
        await engine.start()
        yield
        for task in engine.tasks:
            task.cancel()
        engine.executor.shutdown(wait=False, cancel_futures=True)
        engine.png_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="sd3cluster serve", lifespan=lifespan, docs_url=None, redoc_url=None)

    def refused(e: Refused) -> JSONResponse:
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
        return JSONResponse({"detail": e.message}, status_code=e.code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # pydantic's own messages, with the input echoed only for short values (no prompt dumps in logs).
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    def spec_of(body: GenerationBody) -> Spec:
        return check_request(body, engine.s)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        name = engine.s.name or f"{engine.s.host}:{engine.s.port}"
        if engine.state == "ready":
            return JSONResponse({"ready": True, "worker": name, "queue": len(engine.queue)})
        return JSONResponse({"ready": False, "worker": name, "reason": engine.state}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4")
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/images/generations")
    async def generations(body: GenerationBody, request: Request) -> JSONResponse:
        try:
            spec = spec_of(body)
        except LimitError as e:
            return JSONResponse({"detail": e.detail()}, status_code=422)
        try:
            ticket = engine.admit(spec, job=False)
        except Refused as e:
            return refused(e)
        try:
            await _wait(ticket, request)
        except Refused as e:
            return refused(e)
        return JSONResponse(response_body(ticket))

    async def _wait(ticket: Ticket, request: Request) -> None:
        """Until the ticket's images are made; 504 at its deadline; a client that hung up cancels it."""
        while True:
            remaining = ticket.deadline - time.monotonic()
            if remaining <= 0:
                engine.abandon(ticket, "failed", f"deadline of {engine.s.request_timeout_s:g} s passed")
                raise Refused(504, f"the request did not finish within serve.request_timeout_s "
                                   f"({engine.s.request_timeout_s:g} s)")
            done, _ = await asyncio.wait({ticket.future}, timeout=min(0.5, remaining))
            if done:
                ticket.future.result()  # raises the Refused of a failed ticket
                return
            if await request.is_disconnected():
                engine.abandon(ticket, "cancelled", "the client closed the connection")
                raise Refused(499, "client closed the connection")

    @app.post("/v1/jobs", status_code=202)
    async def submit_job(body: GenerationBody) -> JSONResponse:
        engine.expire_jobs()
        try:
            ticket = engine.admit(spec_of(body), job=True)
        except LimitError as e:
            return JSONResponse({"detail": e.detail()}, status_code=422)
        except Refused as e:
            return refused(e)
        return JSONResponse({"id": ticket.id, "status": ticket.status, "seed": ticket.spec.seed}, status_code=202,
                            headers={"Location": f"/v1/jobs/{ticket.id}"})

    @app.get("/v1/jobs/{job_id}")
    async def job_status(job_id: str) -> JSONResponse:
        engine.expire_jobs()
        ticket = engine.tickets.get(job_id) if job_id in engine.jobs else None
        if ticket is None:
            return JSONResponse({"detail": f"no job {job_id} (unknown, or finished more than "
                                           f"{engine.s.job_ttl_s:g} s ago)"}, status_code=404)
        return JSONResponse(ticket.public())

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str) -> JSONResponse:
        ticket = engine.tickets.get(job_id) if job_id in engine.jobs else None
        if ticket is None:
            return JSONResponse({"detail": f"no job {job_id}"}, status_code=404)
        engine.abandon(ticket, "cancelled", "cancelled by DELETE /v1/jobs/{id}")
        return JSONResponse(ticket.public())

    return BodyLimit(app, engine)


# -- the command -------------------------------------------------------------------------------------------------
def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a taken port is a clear error at once."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UserError(f"serve.host {host!r} is not an address of this machine ({e.strerror})") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); another process has the port or the "
                        "address is not this machine's; set serve.port / serve.host (--port, --host)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _check_inputs(s: ServeConfig) -> Path | None:
    """Everything that can be checked before the port opens: weights, output folder. Returns the checkpoint."""

    from .pipeline import check_pretrained

    if s.pretrained is not None:
        check_pretrained(s.pretrained, "serve.pretrained (--pretrained)")
    if s.lora is not None:
        from .lora import read_lora

        read_lora(s.lora, "serve.lora (--lora)")
    checkpoint = None
    if s.checkpoint is not None:
        from .export import resolve_checkpoint

        checkpoint = resolve_checkpoint(s.checkpoint, s.step)
    if s.output_dir is not None:
        from .checks import writable_folder

        writable_folder(Path(s.output_dir), "serve.output_dir (--output-dir)")
    return checkpoint


def serve(cfg: Config) -> int:
    """Run the service until SIGTERM/SIGINT and a finished drain; the exit status."""
    import uvicorn

    from .dist import pick_device
    from .pipeline import load_pipeline, resolve_dtype

    s = cfg.serve
    # The pipeline thread runs Python between kernels (a lot of it for small models); a 1 ms GIL switch interval
    # instead of 5 lets the event loop answer health checks and refusals (429) within milliseconds meanwhile.
    sys.setswitchinterval(0.001)
    checkpoint = _check_inputs(s)
    device = pick_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    sock = _bind(s.host, s.port)

    def log(line: str) -> None:
        print(f"{line}", flush=True)

    def factory():
        return load_pipeline(cfg.model.preset, device, dtype, s.pretrained, checkpoint, "latest", s.ema,
                             s.max_sequence_length, s.compile, log=log, lora=s.lora, lora_scale=s.lora_scale)

    engine = Engine(cfg, factory, log)
    # The batcher's metrics exist from the start (GPU memory gauges when the device is CUDA).
    engine.metrics = Metrics(device.type == "cuda")
    engine.metrics.queue_capacity.set(s.queue_size)
    app = build_app(engine)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # First SIGTERM/SIGINT: drain (the engine stops the server when done). A second one: exit now.
            if engine.drain_requested.is_set():
                self.should_exit = self.force_exit = True
                return
            engine.drain_requested.set()

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=30,
                            timeout_keep_alive=5, lifespan="on")
    server = DrainingServer(config)

    def stop() -> None:
        server.should_exit = True

    engine.stop_server = stop
    log(f"[serve] {s.name or f'{s.host}:{s.port}'}: listening on http://{s.host}:{s.port} (loading the model; "
        f"/readyz says 503 until it is ready); max_batch {s.max_batch}, max_wait_ms {s.max_wait_ms:g}, "
        f"queue {s.queue_size} images")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return engine.exit_code

