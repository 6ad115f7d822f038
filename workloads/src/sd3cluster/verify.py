"""`sd3cluster verify`: is this set of ranks fit to train? Checks with numbers, a JSON report, a table, an exit code."""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import __version__
from .checkpoint import CheckpointManager
from .config import Config
from .dist import Runtime, all_gather_object, all_reduce, barrier, broadcast_object, hostname, local_runtime
from .train import Trainer


@dataclass
class Check:
    name: str
    passed: bool
    value: Any
    threshold: Any
    unit: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    world_size: int
    device: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({"passed": self.passed, "world_size": self.world_size, "device": self.device,
                           "checks": [asdict(c) for c in self.checks]}, indent=2, default=str)

    def table(self) -> str:
        rows = [("check", "result", "value", "threshold", "unit", "s", "detail")]
        for c in self.checks:
            value = f"{c.value:.4g}" if isinstance(c.value, float) else str(c.value)
            threshold = f"{c.threshold:.4g}" if isinstance(c.threshold, float) else str(c.threshold)
            rows.append((c.name, "PASS" if c.passed else "FAIL", value, threshold, c.unit, f"{c.seconds:.1f}",
                         c.detail))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1]
                 for r in rows]
        lines.append(f"verdict: {'PASS' if self.passed else 'FAIL'} ({sum(c.passed for c in self.checks)}/"
                     f"{len(self.checks)} checks, {self.world_size} ranks)")
        return "\n".join(lines)


def _verify_config(cfg: Config, workdir: Path, steps: int, lr: float | None = None, samples: int | None = None,
                   batch: int | None = None, exact: bool = False) -> Config:
    """The run every check trains: synthetic data, fp32 on CPU, no logging or checkpoints of its own."""
    c = cfg.model_copy(deep=True)
    c.data.synthetic_samples = samples or max(64, c.data.batch_size * 64)
    c.data.path = None
    if batch:
        c.data.batch_size = batch
    c.train.steps = steps
    c.train.kill_at_step = 0
    c.output.dir = workdir / "out"
    c.output.tensorboard = False
    c.output.progress = False
    c.checkpoint.dir = None
    c.train.ordered_reduce = exact
    if lr is not None:
        c.optim.lr = lr
    return c


def _run(cfg: Config, rt: Runtime, steps: int, fixed_batch: bool = False) -> tuple[Trainer, list[float], float]:
    trainer = Trainer(cfg, rt, fixed_batch=fixed_batch)
    losses, start = [], None
    for i in range(steps):
        if i == 1:
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        losses.append(trainer.train_step()["loss"])
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    images_per_s = 0.0
    if start is not None:
        images_per_s = (steps - 1) * trainer.global_micro * cfg.train.grad_accum / (time.perf_counter() - start)
    return trainer, losses, images_per_s


def check_versions(rt: Runtime) -> Check:
    import diffusers

    info = {"host": hostname(), "rank": rt.rank, "python": platform.python_version(), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "sd3cluster": __version__, "device": str(rt.device),
            "device_name": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else platform.machine(),
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))
            if rt.device.type == "cuda" else None}
    everyone = all_gather_object(rt, info)
    differing = [k for k in ("python", "torch", "diffusers", "sd3cluster", "cuda", "nccl")
                 if len({e[k] for e in everyone}) > 1]
    hosts = sorted({e["host"] for e in everyone})
    detail = (f"{len(hosts)} host(s); torch {info['torch']}, diffusers {info['diffusers']}, "
              f"{info['device_name']}") if not differing else "differ: " + ", ".join(
                  f"{k}={sorted({str(e[k]) for e in everyone})}" for k in differing)
    return Check("versions_and_devices", not differing, len(everyone), rt.world, "ranks", detail)


def check_allreduce(cfg: Config, rt: Runtime) -> Check:
    if not rt.distributed or rt.world == 1:
        return Check("allreduce_busbw", True, None, cfg.verify.min_busbw_gbps, "GB/s", "one rank: nothing to measure")
    results = {}
    for size_mb in cfg.verify.allreduce_sizes_mb:
        n = max(1, int(size_mb * 2**20 / 4))
        t = torch.ones(n, device=rt.device)
        for _ in range(2):
            dist.all_reduce(t)
        iters = 5
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        barrier(rt)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - start)
        all_reduce(rt, elapsed, dist.ReduceOp.MAX)
        seconds = float(elapsed) / iters
        results[size_mb] = n * 4 / seconds * 2 * (rt.world - 1) / rt.world / 1e9
    best = max(results.values())
    detail = "; ".join(f"{size:g} MiB: {bw:.3f}" for size, bw in results.items())
    return Check("allreduce_busbw", best >= cfg.verify.min_busbw_gbps, best, cfg.verify.min_busbw_gbps, "GB/s",
                 detail)


def _max_rank_difference(rt: Runtime, flat: torch.Tensor) -> float:
    hi, lo = flat.to(rt.device, copy=True), flat.to(rt.device, copy=True)
    all_reduce(rt, hi, dist.ReduceOp.MAX)
    all_reduce(rt, lo, dist.ReduceOp.MIN)
    return float((hi - lo).abs().max())


def verify(cfg: Config, rt: Runtime) -> Report:
    report = Report(rt.world, str(rt.device))
    exact = rt.device.type == "cpu"
    exact_tol = 0.0 if exact else cfg.verify.tolerance
    workdir = Path(broadcast_object(rt, tempfile.mkdtemp(prefix="sd3verify-") if rt.is_main else None))
    if cfg.checkpoint.dir is not None:  # a shared volume lets the resume check span nodes
        workdir = cfg.checkpoint.dir / "verify-work"
    n = cfg.verify.steps

    def timed(fn, *args) -> None:
        start = time.perf_counter()
        try:
            check = fn(*args)
        except Exception as e:  # a check that breaks is a failed check, not a crash of the report
            check = Check(getattr(fn, "__name__", "check"), False, None, None, "", f"{type(e).__name__}: {e}")
        check.seconds = time.perf_counter() - start
        report.checks.append(check)
        if rt.is_main:
            print(f"[verify] {check.name}: {'PASS' if check.passed else 'FAIL'} ({check.seconds:.1f} s)", flush=True)

    timed(check_versions, rt)
    timed(check_allreduce, cfg, rt)

    state: dict[str, Any] = {}

    def params_identical() -> Check:
        trainer, losses, ips = _run(_verify_config(cfg, workdir, n), rt, n)
        state["distributed"] = trainer.flat_parameters()
        state["images_per_s"] = ips
        diff = _max_rank_difference(rt, state["distributed"])
        return Check("parameters_identical_on_ranks", diff <= exact_tol, diff, exact_tol, "max abs diff",
                     f"after {n} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    def ddp_equals_single() -> Check:
        if "distributed" not in state:
            return Check("ddp_equals_one_process", False, None, cfg.verify.tolerance, "max abs diff",
                         "not run: the distributed run before it failed")
        diff = torch.zeros(())
        if rt.is_main:
            single_cfg = _verify_config(cfg, workdir, n, batch=cfg.data.batch_size * rt.world)
            single_cfg.model.compile = False
            trainer, _, _ = _run(single_cfg, local_runtime(rt.device), n)
            diff = (trainer.flat_parameters() - state["distributed"]).abs().max()
        diff = torch.tensor(float(broadcast_object(rt, float(diff))))
        tol = cfg.verify.tolerance
        return Check("ddp_equals_one_process", float(diff) <= tol, float(diff), tol, "max abs diff",
                     f"{rt.world} ranks x batch {cfg.data.batch_size} vs 1 process x batch "
                     f"{cfg.data.batch_size * rt.world}, {n} steps")

    def resume_exact() -> Check:
        k = cfg.verify.resume_k
        straight, _, _ = _run(_verify_config(cfg, workdir, 2 * k, exact=exact), rt, 2 * k)
        expected = straight.flat_parameters()
        del straight
        ckpt_dir = workdir / "resume-check"
        manager = CheckpointManager(ckpt_dir, rt, keep=1)
        first, _, _ = _run(_verify_config(cfg, workdir, k, exact=exact), rt, k)
        first.save(manager)
        del first
        second = Trainer(_verify_config(cfg, workdir, 2 * k, exact=exact), rt)
        second.load(manager, manager.latest())
        for _ in range(k):
            second.train_step()
        diff = float((second.flat_parameters() - expected).abs().max())
        diff = max(diff, _max_rank_difference(rt, second.flat_parameters()))
        barrier(rt)
        if rt.is_main:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        return Check("resume_exact", diff <= exact_tol, diff, exact_tol, "max abs diff",
                     f"{2 * k} steps straight vs {k} + checkpoint + resume + {k}")

    def loss_falls() -> Check:
        steps = cfg.verify.overfit_steps
        # Every rank trains on the same batch (Trainer's fixed_batch), as one process would.
        c = _verify_config(cfg, workdir, steps, lr=cfg.verify.overfit_lr, samples=cfg.data.batch_size)
        c.optim.warmup_steps = 0
        _, losses, _ = _run(c, rt, steps, fixed_batch=True)
        ratio = losses[-1] / losses[0]
        limit = cfg.verify.overfit_ratio
        return Check("loss_falls_on_one_batch", ratio < limit, ratio, limit, "last/first loss",
                     f"{steps} steps on one batch of {cfg.data.batch_size} on every rank: "
                     f"{losses[0]:.4f} -> {losses[-1]:.4f}")

    def throughput() -> Check:
        ips = state.get("images_per_s", 0.0)
        return Check("throughput", ips > 0 and ips >= cfg.verify.min_images_per_s, ips, cfg.verify.min_images_per_s,
                     "images/s", f"{cfg.model.preset}, {cfg.data.resolution}^2, global batch "
                     f"{cfg.data.batch_size * rt.world * cfg.train.grad_accum}")

    for fn in (params_identical, ddp_equals_single, resume_exact, loss_falls, throughput):
        timed(fn)
    barrier(rt)
    if rt.is_main and cfg.checkpoint.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    if rt.is_main:
        cfg.verify.report.parent.mkdir(parents=True, exist_ok=True)
        cfg.verify.report.write_text(report.to_json())
        print(report.table(), flush=True)
        print(f"report: {cfg.verify.report}", flush=True)
    return report
