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

from . import __version__, hardware
from .checkpoint import CheckpointManager
from .config import Config, ConfigError
from .dist import Runtime, all_gather_object, all_reduce, barrier, broadcast_object, hostname, local_runtime
from .train import Trainer

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    """One result. status: pass, fail, or skip (could not apply here, or nothing to compare with: never a pass)."""

    name: str
    status: str
    value: Any
    threshold: Any
    unit: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "skipped": self.status == SKIP}


def _status(ok: bool) -> str:
    return PASS if ok else FAIL


@dataclass
class Report:
    world_size: int
    device: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No check failed; skipped ones say what was not checked, so the table shows them."""
        return not any(c.failed for c in self.checks)

    def to_json(self) -> str:
        return json.dumps({"passed": self.passed, "world_size": self.world_size, "device": self.device,
                           "checks": [c.as_dict() for c in self.checks]}, indent=2, default=str)

    def table(self) -> str:
        rows = [("check", "result", "value", "threshold", "unit", "s", "detail")]
        for c in self.checks:
            value = f"{c.value:.4g}" if isinstance(c.value, float) else str(c.value)
            threshold = f"{c.threshold:.4g}" if isinstance(c.threshold, float) else str(c.threshold)
            rows.append((c.name, c.status.upper() if c.status != SKIP else SKIP, value, threshold, c.unit,
                         f"{c.seconds:.1f}", c.detail))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1]
                 for r in rows]
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, SKIP)}
        lines.append(f"verdict: {'PASS' if self.passed else 'FAIL'} ({counts[PASS]} passed, {counts[FAIL]} failed, "
                     f"{counts[SKIP]} skipped; {self.world_size} ranks)")
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
    return Check("versions_and_devices", _status(not differing), len(everyone), rt.world, "ranks", detail)


@dataclass(frozen=True)
class Limit:
    """A check's threshold and where it comes from; threshold None: nothing to compare with (the check skips)."""

    threshold: float | None
    source: str


def resolve_limits(cfg: Config, device_name: str | None, gpus_on_node: int, nodes: int) -> dict[str, Limit]:
    """Thresholds of the measured checks: an explicit verify.min_* value, else the hardware profile's expected
    number x verify.threshold_fraction. A GPU no profile knows is an error unless verify.gpu_profile names one."""
    v = cfg.verify
    try:
        profiles = hardware.load_profiles()
        gpu = None
        if v.gpu_profile != "none" and (device_name is not None or v.gpu_profile != "auto"):
            gpu = hardware.gpu_profile_name(profiles, device_name, v.gpu_profile)
        named = v.network_profile not in (None, "", "none")
        network = hardware.network_profile_name(profiles, None, None, v.network_profile) if named else None
        table = hardware.thresholds(profiles, v.threshold_fraction, gpu=gpu, gpus_per_node=gpus_on_node,
                                    network=network, nics=v.nics_per_node, link=v.intra_node_link)
    except hardware.ProfileError as e:
        raise ConfigError(str(e)) from None
    explicit = {hardware.GEMM: ("verify.min_gemm_tflops", v.min_gemm_tflops),
                hardware.MEMORY: ("verify.min_memory_gb_s", v.min_memory_gb_s),
                hardware.INTRA: ("verify.min_busbw_gbps", v.min_busbw_gbps),
                hardware.INTER: ("verify.min_busbw_gbps", v.min_busbw_gbps),
                hardware.TRAIN: ("verify.min_gpu_images_per_s", v.min_gpu_images_per_s)}
    limits = {}
    for check, (key, value) in explicit.items():
        row = table[check]
        if value is not None:
            limits[check] = Limit(value, f"{key}, set explicitly")
        elif row is not None:
            limits[check] = Limit(row["threshold"], f"profile {gpu if check != hardware.INTER else network}: "
                                  f"{row['expected']:g} expected ({row['source']}) x {row['fraction']:g}")
        else:
            limits[check] = Limit(None, "no profile number" + ("" if gpu or check == hardware.INTER else
                                                               " (no GPU profile here)"))
    if nodes < 2:
        limits[hardware.INTER] = Limit(None, "one node")
    return limits


def _judge(name: str, check: str, value: float | None, limit: Limit, detail: str) -> Check:
    status = hardware.verdict(value, limit.threshold)
    why = hardware.explain(check, value, limit.threshold, limit.source)
    return Check(name, status, value, limit.threshold, hardware.UNITS[check], f"{why}; {detail}" if detail else why)


def _allreduce_busbw(rt: Runtime, sizes_mb: list[float], group: Any, size: int) -> dict[float, float]:
    results = {}
    for size_mb in sizes_mb:
        n = max(1, int(size_mb * 2**20 / 4))
        t = torch.ones(n, device=rt.device)
        for _ in range(2):
            dist.all_reduce(t, group=group)
        iters = 5
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, group=group)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - start, device=rt.device)
        dist.all_reduce(elapsed, dist.ReduceOp.MAX, group=group)
        seconds = float(elapsed) / iters
        # nccl-tests' bus bandwidth: what each link carries, comparable across rank counts.
        results[size_mb] = n * 4 / seconds * 2 * (size - 1) / size / 1e9
    return results


def check_allreduce(cfg: Config, rt: Runtime, layout: dict[str, list[int]], limits: dict[str, Limit]) -> list[Check]:
    """Intra-node: the ranks of each node among themselves (every node measured, the slowest reported);
    inter-node: all ranks together, which crosses the network when there are several nodes."""
    if not rt.distributed or rt.world == 1:
        return [Check("allreduce_intra_node", SKIP, None, None, "GB/s", "one rank: no all-reduce to measure"),
                Check("allreduce_inter_node", SKIP, None, None, "GB/s", "one rank: no all-reduce to measure")]
    sizes = cfg.verify.allreduce_sizes_mb
    checks = []
    # new_group is collective: every rank creates every node's group, in the same order.
    groups = {host: dist.new_group(ranks) for host, ranks in sorted(layout.items())}
    mine = next(host for host, ranks in layout.items() if rt.rank in ranks)
    per_node = len(layout[mine])
    bw = max(_allreduce_busbw(rt, sizes, groups[mine], per_node).values()) if per_node > 1 else None
    everyone = all_gather_object(rt, (mine, len(layout[mine]), bw))
    measured = {host: value for host, _, value in everyone if value is not None}
    if not measured:
        checks.append(Check("allreduce_intra_node", SKIP, None, limits[hardware.INTRA].threshold, "GB/s",
                            "one rank per node: no intra-node all-reduce to measure"))
    else:
        slowest = min(measured, key=measured.get)
        detail = "slowest node " + slowest + "; " + ", ".join(f"{h}: {b:.3g}" for h, b in sorted(measured.items()))
        checks.append(_judge("allreduce_intra_node", hardware.INTRA, measured[slowest], limits[hardware.INTRA],
                             detail))
    if len(layout) < 2:
        checks.append(Check("allreduce_inter_node", SKIP, None, None, "GB/s", "all ranks on one node"))
    else:
        results = _allreduce_busbw(rt, sizes, None, rt.world)
        sizes_text = "; ".join(f"{size:g} MiB: {bw:.3g}" for size, bw in results.items())
        detail = f"{len(layout)} nodes, {rt.world} ranks; {sizes_text}"
        checks.append(_judge("allreduce_inter_node", hardware.INTER, max(results.values()), limits[hardware.INTER],
                             detail))
    return checks


def gemm_tflops(device: torch.device, n: int, iters: int = 20, rounds: int = 3) -> float:
    """bf16 n x n x n matrix multiplies (cuBLAS): the best of a few rounds, so one hiccup is not a failure."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    best = 0.0
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    return best


def copy_bandwidth_gb_s(device: torch.device, mb: int, iters: int = 20, rounds: int = 3) -> float:
    """Device-to-device copy of an mb MiB buffer (STREAM copy): bytes read plus bytes written per second."""
    src = torch.ones(mb * 2**20 // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = 0.0
    for _ in range(rounds):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        torch.cuda.synchronize(device)
        best = max(best, 2 * src.numel() * 4 * iters / (time.perf_counter() - start) / 1e9)
    return best


def _per_gpu(rt: Runtime, name: str, check: str, limit: Limit, measure: Any) -> Check:
    """Every rank measures its own GPU at once; the slowest decides, and the detail names it."""
    value, why, broke = None, "no GPU on this rank", False
    if rt.device.type == "cuda":
        try:
            value, why = measure()
        except Exception as e:  # every rank must reach the gather below, or the others wait forever
            value, why, broke = None, f"{type(e).__name__}: {e}", True
    everyone = all_gather_object(rt, (hostname(), rt.local_rank, value, why, broke))
    broken = [f"{h}:{lr} {w}" for h, lr, _, w, b in everyone if b]
    if broken:
        return Check(name, FAIL, None, limit.threshold, hardware.UNITS[check], "; ".join(broken)[:2000])
    got = [(v, h, lr, w) for h, lr, v, w, _ in everyone if v is not None]
    if not got:
        return Check(name, SKIP, None, limit.threshold, hardware.UNITS[check], everyone[0][3])
    slowest = min(got)
    detail = f"slowest GPU {slowest[1]}:{slowest[2]} of {len(got)}; " + ", ".join(
        f"{h}:{lr} {v:.4g}" for v, h, lr, _ in sorted(got, key=lambda g: (g[1], g[2])))
    if slowest[3]:  # what the measurement says of how it ran there (the training check: its kernels)
        detail += f"; on {slowest[1]}:{slowest[2]}: {slowest[3]}"
    return _judge(name, check, slowest[0], limit, detail)


def _gpu_training_config(cfg: Config, preset: dict[str, Any], workdir: Path) -> Config:
    c = _verify_config(cfg, workdir, preset["warmup_steps"] + preset["timed_steps"],
                       samples=preset["batch_size"] * 2, batch=preset["batch_size"])
    c.model.preset = preset["model"]
    c.model.pretrained = None
    c.model.compile = bool(preset["compile"])
    c.data.resolution = preset["resolution"]
    c.data.text_tokens = preset["text_tokens"]
    c.train.precision = preset["precision"]
    c.train.parallel = "ddp"
    c.train.ordered_reduce = False
    return c


def gpu_training_images_per_s(cfg: Config, rt: Runtime, workdir: Path) -> tuple[float | None, str]:
    """The fixed verify preset on this GPU alone (no communication): images/s after its warm-up steps, and the
    kernels it ran with (a GPU without the fa4 extra trains slower: the detail shows it)."""
    preset = hardware.load_profiles()["verify_preset"]
    memory_gb = torch.cuda.get_device_properties(rt.device).total_memory / 1e9
    if memory_gb < preset["min_memory_gb"] * 0.95:  # vendors' "80 GB" is 79.x GiB-ish in bytes
        return None, (f"the verify preset ({preset['model']}, {preset['resolution']}^2, batch {preset['batch_size']}) "
                      f"needs about {preset['min_memory_gb']} GB; this GPU has {memory_gb:.0f}")
    c = _gpu_training_config(cfg, preset, workdir)
    torch.cuda.empty_cache()
    trainer = Trainer(c, local_runtime(rt.device))
    try:
        for _ in range(preset["warmup_steps"]):
            trainer.train_step()
        torch.cuda.synchronize(rt.device)
        start = time.perf_counter()
        for _ in range(preset["timed_steps"]):
            trainer.train_step()
        torch.cuda.synchronize(rt.device)
        seconds = time.perf_counter() - start
    finally:
        trainer.close()
    return preset["timed_steps"] * preset["batch_size"] / seconds, f"kernels: {trainer.kernel_note}"


def node_layout(rt: Runtime) -> dict[str, list[int]]:
    """host -> its ranks."""
    layout: dict[str, list[int]] = {}
    for rank, host in enumerate(all_gather_object(rt, hostname())):
        layout.setdefault(host, []).append(rank)
    return layout


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
    layout = node_layout(rt)
    device_name = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else None
    # Resolved before any check runs: an unknown GPU or a misspelt profile stops here with its fix.
    limits = resolve_limits(cfg, device_name, len(next(r for r in layout.values() if rt.rank in r)), len(layout))

    def timed(fn, *args) -> None:
        start = time.perf_counter()
        try:
            checks = fn(*args)
        except Exception as e:  # a check that breaks is a failed check, not a crash of the report
            checks = Check(getattr(fn, "__name__", "check"), FAIL, None, None, "", f"{type(e).__name__}: {e}")
        for check in checks if isinstance(checks, list) else [checks]:
            check.seconds = time.perf_counter() - start
            report.checks.append(check)
            if rt.is_main:
                print(f"[verify] {check.name}: {check.status.upper()} ({check.seconds:.1f} s) {check.detail}",
                      flush=True)

    timed(check_versions, rt)
    size, mb = cfg.verify.gemm_size, cfg.verify.memory_mb
    timed(_per_gpu, rt, "gpu_gemm_bf16", hardware.GEMM, limits[hardware.GEMM],
          lambda: (gemm_tflops(rt.device, size), ""))
    timed(_per_gpu, rt, "gpu_memory_bandwidth", hardware.MEMORY, limits[hardware.MEMORY],
          lambda: (copy_bandwidth_gb_s(rt.device, mb), ""))
    timed(check_allreduce, cfg, rt, layout, limits)

    state: dict[str, Any] = {}

    def params_identical() -> Check:
        trainer, losses, ips = _run(_verify_config(cfg, workdir, n), rt, n)
        state["distributed"] = trainer.flat_parameters()
        state["images_per_s"] = ips
        diff = _max_rank_difference(rt, state["distributed"])
        return Check("parameters_identical_on_ranks", _status(diff <= exact_tol), diff, exact_tol, "max abs diff",
                     f"after {n} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    def ddp_equals_single() -> Check:
        if "distributed" not in state:
            return Check("ddp_equals_one_process", FAIL, None, cfg.verify.tolerance, "max abs diff",
                         "not run: the distributed run before it failed")
        diff = torch.zeros(())
        if rt.is_main:
            single_cfg = _verify_config(cfg, workdir, n, batch=cfg.data.batch_size * rt.world)
            single_cfg.model.compile = False
            trainer, _, _ = _run(single_cfg, local_runtime(rt.device), n)
            diff = (trainer.flat_parameters() - state["distributed"]).abs().max()
        diff = torch.tensor(float(broadcast_object(rt, float(diff))))
        tol = cfg.verify.tolerance
        return Check("ddp_equals_one_process", _status(float(diff) <= tol), float(diff), tol, "max abs diff",
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
        return Check("resume_exact", _status(diff <= exact_tol), diff, exact_tol, "max abs diff",
                     f"{2 * k} steps straight vs {k} + checkpoint + resume + {k}")

    def loss_falls() -> Check:
        steps = cfg.verify.overfit_steps
        # Every rank trains on the same batch (Trainer's fixed_batch), as one process would.
        c = _verify_config(cfg, workdir, steps, lr=cfg.verify.overfit_lr, samples=cfg.data.batch_size)
        c.optim.warmup_steps = 0
        _, losses, _ = _run(c, rt, steps, fixed_batch=True)
        ratio = losses[-1] / losses[0]
        limit = cfg.verify.overfit_ratio
        return Check("loss_falls_on_one_batch", _status(ratio < limit), ratio, limit, "last/first loss",
                     f"{steps} steps on one batch of {cfg.data.batch_size} on every rank: "
                     f"{losses[0]:.4f} -> {losses[-1]:.4f}")

    def throughput() -> Check:
        ips = state.get("images_per_s")
        threshold = cfg.verify.min_images_per_s
        setup = (f"{cfg.model.preset}, {cfg.data.resolution}^2, global batch "
                 f"{cfg.data.batch_size * rt.world * cfg.train.grad_accum}")
        if ips is None or ips <= 0:
            return Check("throughput", FAIL, ips, threshold, "images/s",
                         f"not measured: the training run failed; {setup}")
        if threshold is None:  # this config's speed has no expected number; the per-GPU check has one
            return Check("throughput", SKIP, ips, None, "images/s", f"no threshold (verify.min_images_per_s); {setup}")
        return Check("throughput", _status(ips >= threshold), ips, threshold, "images/s",
                     f"{ips:.4g} images/s, {'at least' if ips >= threshold else 'below the threshold'} {threshold:.4g} "
                     f"(verify.min_images_per_s); {setup}")

    def gpu_training() -> Check:
        if not cfg.verify.gpu_training:
            return Check("gpu_training_images_per_s", SKIP, None, None, hardware.UNITS[hardware.TRAIN],
                         "verify.gpu_training is false")
        return _per_gpu(rt, "gpu_training_images_per_s", hardware.TRAIN, limits[hardware.TRAIN],
                        lambda: gpu_training_images_per_s(cfg, rt, workdir))

    for fn in (params_identical, ddp_equals_single, resume_exact, loss_falls, throughput, gpu_training):
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
