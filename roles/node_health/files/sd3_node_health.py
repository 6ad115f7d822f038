#!/usr/bin/env python3
"""Node health check, NHC-style: is this node fit to run jobs? Slurm runs it as HealthCheckProgram.

Checks: the NVIDIA driver answers, the GPU count, uncorrectable ECC (volatile), retired pages and row-remap
failures, XID errors in the kernel log since the last run, PCIe link width and generation against their maximum,
clock-throttle reasons, NVLink state, persistence mode, the enforced power limit against the card's default, DCGM
diagnostics level 1 (where dcgmi exists), the shared volume mounted and writable, free disk. Each check reads pass,
fail or skip (it cannot apply here: no GPU expected and no driver, no NVLink, no dcgmi, no power limits reported).

With --slurm it then drains this node (reason "<prefix> <check>: <detail>") when a check fails, and resumes it when
all pass again and the drain was its own: a drain whose reason lacks the prefix is an admin's and is left alone.
It writes one Prometheus metric per check to node_exporter's textfile directory.

The settings come from a JSON file (--config) the node_health role writes. `recorded_dir` points the checks at
recorded command outputs (nvidia-smi-query.csv, nvidia-smi-nvlink.txt, dmesg.txt, lspci.txt, dcgmi-diag.txt) instead
of running the commands: the tests drain and resume nodes without GPUs that way. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sd3_textfile import Family, render, run_command, write_atomically

PASS, FAIL, SKIP = "pass", "fail", "skip"

# Asked of nvidia-smi in one call; a field an older driver does not know is dropped and its check skips.
QUERY_FIELDS = [
    "index", "pci.bus_id", "name", "persistence_mode", "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending", "remapped_rows.failure", "remapped_rows.pending", "pcie.link.gen.max",
    "pcie.link.gen.gpumax", "pcie.link.width.current", "pcie.link.width.max", "clocks_event_reasons.active",
    "enforced.power.limit", "power.default_limit",
]
# Drivers before 530 name the clock reasons "throttle"; newer ones "event" (and accept both).
FIELD_ALIASES = {"clocks_throttle_reasons.active": "clocks_event_reasons.active"}
# Clock-event reasons that mean the hardware is slowed by a fault or heat; idle, application clocks, the
# software power cap and sync boost are normal operation (nvidia-smi -q -d PERFORMANCE lists them).
BAD_CLOCK_REASONS = {0x8: "hardware slowdown", 0x20: "software thermal slowdown", 0x40: "hardware thermal slowdown",
                     0x80: "hardware power brake"}
XID = re.compile(r"^\[\s*([\d.]+)\]\s.*NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")
UNAVAILABLE = ("[n/a]", "n/a", "[not supported]", "not supported", "[unknown error]", "")
CHECKS = ("driver", "gpu_count", "ecc_uncorrected", "retired_pages_row_remap", "xid_errors", "pcie_link",
          "clock_throttle", "nvlink", "persistence_mode", "power_limit", "dcgm_diag", "shared_volume", "free_disk")
GPU_CHECKS = CHECKS[:CHECKS.index("dcgm_diag") + 1]


@dataclass
class Result:
    check: str
    status: str
    detail: str = ""


# -- parsers: pure functions of recorded outputs ---------------------------------------------------------------
def parse_query(text: str) -> list[dict[str, str | None]]:
    """`nvidia-smi --query-gpu=... --format=csv,nounits` (with its header) -> one dict per GPU; [N/A] -> None."""
    rows = list(csv.reader(text.strip().splitlines(), skipinitialspace=True))
    if not rows:
        return []
    header = [FIELD_ALIASES.get(h, h) for h in (re.sub(r"\s*\[.*\]$", "", h.strip()) for h in rows[0])]
    gpus = []
    for number, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        if len(row) != len(header):
            raise ValueError(f"nvidia-smi line {number} has {len(row)} values for {len(header)} fields")
        gpus.append({k: (None if v.strip().lower() in UNAVAILABLE else v.strip()) for k, v in zip(header, row,
                                                                                                  strict=True)})
    return gpus


def parse_lspci(text: str) -> list[dict[str, object]]:
    """`lspci -D -vv -d 10de:` -> the NVIDIA GPUs (3D/VGA controllers, not NVSwitch bridges) with their link
    capability and status: {'bus', 'cap_speed', 'cap_width', 'sta_speed', 'sta_width'}."""
    devices, current = [], None
    for line in text.splitlines():
        head = re.match(r"^([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d) (.+?):", line)
        if head:
            is_gpu = head.group(2) in ("3D controller", "VGA compatible controller")
            current = {"bus": head.group(1).lower()} if is_gpu else None
            if current is not None:
                devices.append(current)
            continue
        if current is None:
            continue
        link = re.search(r"Lnk(Cap|Sta):.*?Speed ([\d.]+)GT/s.*?Width x(\d+)", line)
        if link:
            kind = link.group(1).lower()
            current[f"{kind}_speed"] = float(link.group(2))
            current[f"{kind}_width"] = int(link.group(3))
    return devices


def parse_xids(text: str) -> list[tuple[float, str, int]]:
    """Kernel log (`dmesg`, seconds since boot) -> [(time, PCI bus id, XID code)]."""
    events = []
    for line in text.splitlines():
        match = XID.search(line)
        if match:
            events.append((float(match.group(1)), match.group(2).lower(), int(match.group(3))))
    return events


def parse_nvlink(text: str) -> dict[str, tuple[int, int]]:
    """`nvidia-smi nvlink -s` -> GPU line -> (links up, links present). Empty: no NVLink on this node."""
    gpus: dict[str, tuple[int, int]] = {}
    gpu = None
    for line in text.splitlines():
        if line.startswith("GPU "):
            gpu = line.split(":")[0]
            gpus[gpu] = (0, 0)
        elif gpu and re.match(r"\s+Link \d+:", line):
            up, total = gpus[gpu]
            gpus[gpu] = (up + (0 if "inactive" in line.lower() else 1), total + 1)
    return {g: counts for g, counts in gpus.items() if counts[1] > 0}


# -- checks -----------------------------------------------------------------------------------------------------
def _gpu_label(gpu: dict[str, str | None]) -> str:
    return f"GPU {gpu.get('index')} ({(gpu.get('pci.bus_id') or '?').lower()})"


def _field_check(name: str, gpus: list[dict], field: str, bad, describe) -> Result:
    values = [(g, g.get(field)) for g in gpus]
    known = [(g, v) for g, v in values if v is not None]
    if not known:
        return Result(name, SKIP, f"{field} is not reported by this driver or GPU")
    failing = [f"{_gpu_label(g)}: {describe(v)}" for g, v in known if bad(v)]
    return Result(name, FAIL if failing else PASS, "; ".join(failing) or f"{len(known)} GPU(s) fine")


def gpu_checks(query: str | None, error: str, expected: int, lspci: list[dict] | None, new_xids: list | None,
               xid_fatal: list[int], nvlink: dict | None, dcgm: tuple[int, str] | str | None,
               min_power_limit_percent: float = 100) -> list[Result]:
    """dcgm: (exit code, output) of `dcgmi diag`, or why it did not run (a string), or None: no dcgmi.
    min_power_limit_percent: the share of its default power limit a GPU's enforced limit must reach; 0 skips."""
    gpu_names = GPU_CHECKS
    if query is None:
        if expected == 0:
            return [Result(c, SKIP, "no NVIDIA driver and no GPUs expected on this node") for c in gpu_names]
        return [Result("driver", FAIL, f"nvidia-smi does not answer: {error}")] + [
            Result(c, SKIP, "the driver does not answer") for c in gpu_names[1:]]
    try:
        gpus = parse_query(query)
    except ValueError as e:
        return [Result("driver", FAIL, f"nvidia-smi printed what this check cannot read: {e}")] + [
            Result(c, SKIP, "the driver's answer cannot be read") for c in gpu_names[1:]]
    results = [Result("driver", PASS, f"{len(gpus)} GPU(s), {gpus[0].get('name') if gpus else 'none'}")]

    on_bus = len(lspci) if lspci is not None else None
    problems = []
    if expected and len(gpus) < expected:
        problems.append(f"nvidia-smi lists {len(gpus)} GPU(s), the inventory promises {expected}")
    if on_bus is not None and on_bus > len(gpus):
        problems.append(f"{on_bus} NVIDIA GPU(s) on the PCI bus but nvidia-smi lists {len(gpus)}: one fell off the bus")
    if not gpus and not expected:
        problems.append("nvidia-smi answers but lists no GPU")
    results.append(Result("gpu_count", FAIL if problems else PASS, "; ".join(problems) or
                          f"{len(gpus)} GPU(s) (expected {expected or 'any'})"))

    results.append(_field_check("ecc_uncorrected", gpus, "ecc.errors.uncorrected.volatile.total",
                                lambda v: float(v) > 0,
                                lambda v: f"{v} uncorrectable ECC error(s) since the driver loaded"))
    def flagged(gpu: dict, field: str) -> bool:
        return (gpu.get(field) or "").lower() in ("yes", "1", "true")

    remap = []
    for gpu in gpus:
        if flagged(gpu, "retired_pages.pending"):
            remap.append(f"{_gpu_label(gpu)}: retired pages pending (reset the GPU)")
        if flagged(gpu, "remapped_rows.failure"):
            remap.append(f"{_gpu_label(gpu)}: row remapping failed (replace the GPU)")
        if flagged(gpu, "remapped_rows.pending"):
            remap.append(f"{_gpu_label(gpu)}: row remap pending (reset the GPU)")
    reported = any(gpu.get(f) is not None for gpu in gpus for f in ("retired_pages.pending", "remapped_rows.failure",
                                                                    "remapped_rows.pending"))
    results.append(Result("retired_pages_row_remap", FAIL if remap else PASS if reported else SKIP,
                          "; ".join(remap) or ("none pending or failed" if reported
                                               else "not reported by this driver")))

    fatal = [(t, bus, code) for t, bus, code in new_xids or [] if code in xid_fatal]
    if new_xids is None:
        results.append(Result("xid_errors", SKIP, "the kernel log cannot be read here (dmesg)"))
    else:
        results.append(Result("xid_errors", FAIL if fatal else PASS,
                              "; ".join(f"XID {code} on {bus} at {t:.0f} s after boot" for t, bus, code in fatal)
                              or f"no fatal XID since the last check ({len(new_xids)} other XID event(s))"))

    pcie = []
    for gpu in gpus:
        width, width_max = gpu.get("pcie.link.width.current"), gpu.get("pcie.link.width.max")
        if width and width_max and int(width) < int(width_max):
            pcie.append(f"{_gpu_label(gpu)}: link x{width} of x{width_max}")
        gen, gen_gpu = gpu.get("pcie.link.gen.max"), gpu.get("pcie.link.gen.gpumax")
        # The current generation drops at idle to save power; a link whose maximum is below the GPU's is a slot
        # or riser fault.
        if gen and gen_gpu and int(gen) < int(gen_gpu):
            pcie.append(f"{_gpu_label(gpu)}: link at most gen {gen}, the GPU does gen {gen_gpu}")
    for device in lspci or []:
        if device.get("sta_width") and device.get("cap_width") and device["sta_width"] < device["cap_width"]:
            text = f"{device['bus']}: lspci LnkSta x{device['sta_width']} of LnkCap x{device['cap_width']}"
            if not any(device["bus"][5:] in p.lower() for p in pcie):
                pcie.append(text)
    known = any(g.get("pcie.link.width.current") for g in gpus) or bool(lspci)
    results.append(Result("pcie_link", FAIL if pcie else PASS if known else SKIP,
                          "; ".join(pcie) or ("every link at its maximum width" if known else "link not reported")))

    def clock_bad(value: str) -> bool:
        return bool(int(value, 16) & sum(BAD_CLOCK_REASONS))

    def clock_text(value: str) -> str:
        mask = int(value, 16)
        return ", ".join(text for bit, text in BAD_CLOCK_REASONS.items() if mask & bit) + f" ({value})"

    results.append(_field_check("clock_throttle", gpus, "clocks_event_reasons.active", clock_bad, clock_text))

    if not nvlink:
        results.append(Result("nvlink", SKIP, "no NVLink on this node"))
    else:
        down = [f"{gpu}: {up} of {total} links up" for gpu, (up, total) in sorted(nvlink.items()) if up < total]
        results.append(Result("nvlink", FAIL if down else PASS,
                              "; ".join(down) or f"all links up on {len(nvlink)} GPU(s)"))

    results.append(_field_check("persistence_mode", gpus, "persistence_mode", lambda v: v.lower() != "enabled",
                                lambda v: f"persistence mode {v} (the driver unloads between jobs; enable it)"))
    results.append(power_limit_check(gpus, min_power_limit_percent))
    if dcgm is None or isinstance(dcgm, str):
        results.append(Result("dcgm_diag", SKIP, dcgm or "dcgmi is not installed"))
    else:
        rc, out = dcgm
        failed = [line.strip() for line in out.splitlines() if "fail" in line.lower()]
        results.append(Result("dcgm_diag", PASS if rc == 0 and not failed else FAIL,
                              "level 1 passed" if rc == 0 and not failed else "; ".join(failed[:3]) or f"exit {rc}"))
    return results


def power_limit_check(gpus: list[dict], min_percent: float) -> Result:
    """A GPU whose enforced power limit is below its default runs a training step at a lower clock (an H100 held
    at its 700 W limit already drops from 1,980 to about 1,600 MHz): a cap an admin, a cloud image or a stale
    `nvidia-smi -pl` left behind slows the whole job, since every rank waits for the slowest."""
    if min_percent <= 0:
        return Result("power_limit", SKIP, "turned off (node_health_min_power_limit_percent is 0)")
    known = [(g, float(g["enforced.power.limit"]), float(g["power.default_limit"])) for g in gpus
             if g.get("enforced.power.limit") is not None and g.get("power.default_limit") is not None]
    if not known:
        return Result("power_limit", SKIP, "power limits are not reported by this driver or GPU")
    # half a watt for the driver's rounding of the two values
    low = [f"{_gpu_label(g)}: enforced power limit {limit:g} W, {100 * limit / default:.0f}% of its default "
           f"{default:g} W (sudo nvidia-smi -i {g.get('index')} -pl {default:g})"
           for g, limit, default in known if limit + 0.5 < default * min_percent / 100]
    return Result("power_limit", FAIL if low else PASS,
                  "; ".join(low) or f"{len(known)} GPU(s) at {min_percent:g}% or more of their default limit")


def shared_volume_check(path: str) -> Result:
    if not path:
        return Result("shared_volume", SKIP, "no shared volume configured")
    if not os.path.ismount(path):
        return Result("shared_volume", FAIL, f"{path} is not mounted")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".sd3-health-", delete=True) as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as e:
        return Result("shared_volume", FAIL, f"{path} is mounted but not writable: {e.strerror}")
    return Result("shared_volume", PASS, f"{path} mounted and writable")


def free_disk_check(path: str, min_gb: float) -> Result:
    try:
        stats = os.statvfs(path)
    except OSError as e:
        return Result("free_disk", FAIL, f"{path}: {e.strerror}")
    free = stats.f_bavail * stats.f_frsize / 1e9
    ok = free >= min_gb
    return Result("free_disk", PASS if ok else FAIL, f"{free:.1f} GB free under {path}, "
                  f"{'at least' if ok else 'below'} {min_gb:g} GB (node_health_min_free_disk_gb)")


# -- XIDs since the last run -----------------------------------------------------------------------------------
def new_xids(events: list[tuple[float, str, int]], state: dict, boot_id: str) -> tuple[list, dict]:
    """Events after the last run's newest one (in this boot), and the state to keep. A fatal XID stays failing until
    the node reboots or an admin acknowledges it (--acknowledge-xid): the next run sees no new line, but the GPU is
    not healed by that."""
    if state.get("boot_id") != boot_id:
        state = {"boot_id": boot_id, "last_time": -1.0, "pending": []}
    fresh = [e for e in events if e[0] > state["last_time"]]
    pending = [tuple(p) for p in state["pending"]] + fresh
    last = max([state["last_time"]] + [e[0] for e in events])
    return pending, {"boot_id": boot_id, "last_time": last, "pending": [list(p) for p in pending]}


# -- Slurm -------------------------------------------------------------------------------------------------------
def slurm_node(scontrol_show: str) -> tuple[set[str], str]:
    """`scontrol show node NAME` -> (state flags, drain reason)."""
    state = re.search(r"\bState=(\S+)", scontrol_show)
    reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?\s*$", scontrol_show, re.MULTILINE)
    flags = set(state.group(1).upper().split("+")) if state else set()
    return flags, reason.group(1).strip() if reason and reason.group(1).strip() != "(null)" else ""


def slurm_action(flags: set[str], reason: str, failures: list[Result], prefix: str) -> tuple[str, str]:
    """What to do: ('drain', reason), ('resume', ''), or ('none', why). An admin's drain is never touched."""
    drained = bool(flags & {"DRAIN", "DRAINED", "DRAINING"})
    ours = reason.startswith(prefix)
    if failures:
        want = f"{prefix} " + "; ".join(f"{r.check}: {r.detail}" for r in failures)
        want = want[:250]  # scontrol keeps reasons short; the metrics hold the rest
        if drained and not ours:
            return "none", f"drained by an admin ({reason}); left as it is"
        if drained and reason == want:
            return "none", "already drained for this reason"
        return "drain", want
    if drained and ours:
        return "resume", ""
    if drained:
        return "none", f"drained by an admin ({reason}); left as it is"
    return "none", "healthy"


def run_slurm(node: str, failures: list[Result], prefix: str, scontrol: str = "scontrol") -> tuple[str, str]:
    shown = subprocess.run([scontrol, "show", "node", node], capture_output=True, text=True, check=False, timeout=30)
    if shown.returncode != 0:
        return "error", f"scontrol show node {node} failed: {shown.stderr.strip()}"
    flags, reason = slurm_node(shown.stdout)
    action, text = slurm_action(flags, reason, failures, prefix)
    if action == "drain":
        argv = [scontrol, "update", f"nodename={node}", "state=drain", f"reason={text}"]
    elif action == "resume":
        argv = [scontrol, "update", f"nodename={node}", "state=resume"]
    else:
        return action, text
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        return "error", f"{' '.join(argv[:4])} failed: {done.stderr.strip()}"
    return action, text


# -- running the commands (or reading their recorded outputs) -----------------------------------------------------
def _command(argv: list[str], recorded: Path | None, name: str, timeout: float = 60) -> tuple[str | None, str]:
    if recorded is not None:
        path = recorded / name
        return (path.read_text(errors="replace"), "") if path.is_file() else (None, f"{path} is not there")
    return run_command(argv, timeout)


def query_gpus(nvidia_smi: str, recorded: Path | None) -> tuple[str | None, str]:
    """One nvidia-smi call; a field this driver does not know is left out and the query repeated."""
    fields = list(QUERY_FIELDS)
    while True:
        out, err = _command([nvidia_smi, f"--query-gpu={','.join(fields)}", "--format=csv,nounits"], recorded,
                            "nvidia-smi-query.csv")
        unknown = re.search(r'Field "([^"]+)" is not a valid field', err)
        if out is not None or not unknown or unknown.group(1) not in fields:
            return out, err
        fields.remove(unknown.group(1))


def run_checks(cfg: dict) -> tuple[list[Result], dict]:
    recorded = Path(cfg["recorded_dir"]) if cfg.get("recorded_dir") else None
    smi = cfg.get("nvidia_smi", "nvidia-smi")
    query, error = query_gpus(smi, recorded)
    lspci_text, _ = _command(["lspci", "-D", "-vv", "-d", "10de:"], recorded, "lspci.txt")
    lspci = parse_lspci(lspci_text) if lspci_text is not None else None
    dmesg, _ = _command(["dmesg"], recorded, "dmesg.txt")
    state_file = Path(cfg["state_dir"]) / "xid-state.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {}
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip() if recorded is None else "recorded"
    pending, state = new_xids(parse_xids(dmesg or ""), state, boot_id)
    if dmesg is None:  # unreadable (a container, kernel.dmesg_restrict): no XID verdict, and keep the old state
        pending = None
    nvlink_text = _command([smi, "nvlink", "-s"], recorded, "nvidia-smi-nvlink.txt")[0] if query is not None else None
    dcgm = None
    if recorded is not None and (recorded / "dcgmi-diag.txt").is_file():
        dcgm = (0 if "fail" not in (recorded / "dcgmi-diag.txt").read_text().lower() else 1,
                (recorded / "dcgmi-diag.txt").read_text())
    elif recorded is None and query is not None and shutil.which("dcgmi") and int(cfg.get("dcgm_level", 1)) > 0:
        # The diagnostic loads the GPUs: never under a running job (it would slow it, and fail on busy memory).
        apps, _ = _command([smi, "--query-compute-apps=pid", "--format=csv,noheader"], None, "")
        busy = [line for line in (apps or "").splitlines() if line.strip()]
        if busy:
            dcgm = f"{len(busy)} process(es) use the GPUs; the DCGM diagnostic runs on idle GPUs only"
        else:
            done = subprocess.run(["dcgmi", "diag", "-r", str(cfg.get("dcgm_level", 1))], capture_output=True,
                                  text=True, check=False, timeout=600)
            dcgm = (done.returncode, done.stdout + done.stderr)
    results = gpu_checks(query, error, int(cfg.get("expected_gpus", 0)), lspci, pending,
                         [int(x) for x in cfg.get("xid_fatal", [])], parse_nvlink(nvlink_text or ""), dcgm,
                         float(cfg.get("min_power_limit_percent", 100)))
    results.append(shared_volume_check(cfg.get("shared_path", "")))
    results.append(free_disk_check(cfg.get("disk_path", "/"), float(cfg.get("min_free_disk_gb", 0))))
    return results, state


def metrics(results: list[Result], drained: dict[str, int], now: float) -> str:
    ok = Family("sd3_node_health_check_ok", "1 when the health check passed, 0 when it failed (absent when skipped).")
    skipped = Family("sd3_node_health_check_skipped", "1 when the health check could not apply on this node.")
    for r in results:
        skipped.add(1 if r.status == SKIP else 0, check=r.check)
        if r.status != SKIP:
            ok.add(1 if r.status == PASS else 0, check=r.check)
    healthy = Family("sd3_node_health_healthy", "1 when no health check failed.")
    healthy.add(0 if any(r.status == FAIL for r in results) else 1)
    drain = Family("sd3_node_health_drained", "1 when Slurm has this node drained, by the health check or an admin.")
    for by, value in sorted(drained.items()):
        drain.add(value, by=by)
    last = Family("sd3_node_health_last_run_timestamp_seconds", "When the health check last ran.")
    last.add(now)
    return render([ok, skipped, healthy, drain, last])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("/etc/sd3-node-health.json"))
    parser.add_argument("--slurm", action="store_true", help="drain or resume this node in Slurm")
    parser.add_argument("--acknowledge-xid", action="store_true", help="forget the XID errors seen so far")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    try:
        cfg = json.loads(args.config.read_text())
    except (OSError, ValueError) as e:
        print(f"sd3-node-health: cannot read {args.config}: {e}; run the node_health role", file=sys.stderr)
        return 2
    state_dir = Path(cfg["state_dir"])
    state_dir.mkdir(parents=True, exist_ok=True)
    if args.acknowledge_xid:
        (state_dir / "xid-state.json").unlink(missing_ok=True)
    results, state = run_checks(cfg)
    (state_dir / "xid-state.json").write_text(json.dumps(state))
    failures = [r for r in results if r.status == FAIL]
    action, text = "none", "not asked to act (--slurm)"
    drained = {}
    if args.slurm:
        action, text = run_slurm(cfg["node_name"], failures, cfg.get("drain_prefix", "sd3-health:"))
        ours = action == "drain" or (action == "none" and text.startswith("already drained"))
        admin = action == "none" and text.startswith("drained by an admin")
        drained = {"health_check": int(ours), "admin": int(admin)}
    if cfg.get("textfile_dir"):
        write_atomically(Path(cfg["textfile_dir"]), "sd3_node_health.prom", metrics(results, drained, time.time()))
    if args.json:
        print(json.dumps({"healthy": not failures, "slurm": {"action": action, "detail": text},
                          "checks": [asdict(r) for r in results]}, indent=2))
    else:
        for r in results:
            print(f"{r.check:24} {r.status:4}  {r.detail}")
        print(f"slurm: {action} {text}".rstrip())
    return 1 if failures or action == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
