"""Peak GPU memory and images/s of SD3 training per memory option: which configurations fit which card.

Every case runs in its own process (one after the other, same GPU, same call), through sd3cluster's own Trainer
(the code `sd3cluster train` runs) on synthetic precomputed latents and text embeddings: the text encoders and
the VAE are never loaded, as in a real run on `prepare`d shards. Random weights (nothing is downloaded).
Measured per case: peak allocated and peak reserved GPU memory over warm-up and timed steps
(torch.cuda.max_memory_{allocated,reserved}, reset after the model is built: see run_case), and images/s over
--steps timed steps (device synchronised).
A case whose name ends in `@24g` runs under torch.cuda.set_per_process_memory_fraction(24 GiB / total): the
allocator refuses anything beyond, as on a 24 GB card.

    python3 benchmarks/sd3_memory.py --out benchmarks/sd3_memory.json            # the default cases, H200
    python3 benchmarks/sd3_memory.py --preset tiny --resolution 32 --device cpu   # the same code path on CPU
    python3 benchmarks/sd3_memory.py --case "mine=train.mode=lora,lora.rank=64"   # own cases (--set syntax)

A card "fits" a case when its peak reserved memory plus --context-gib (the CUDA context and cuBLAS/cuDNN
workspaces, which torch does not count) is at most the card's memory: 24 GB = 23.99 GiB (RTX 3090/4090),
40 GB = 40 GiB (A100-40G), 48 GB = 47.99 GiB (RTX 6000 Ada, L40S), 80 GB = 80 GiB (A100/H100-80G).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workloads" / "src"))

CARDS_GIB = {"24GB": 24564 / 1024, "40GB": 40.0, "48GB": 49140 / 1024, "80GB": 80.0}
LORA = "train.mode=lora,lora.rank=16,lora.alpha=16"
# name -> --set overrides; a preset prefix "sd35-large:" picks another model than --preset.
DEFAULT_CASES = {
    "lora-r16-b1": f"{LORA},data.batch_size=1",
    "lora-r16-b1@24g": f"{LORA},data.batch_size=1",
    "lora-r16-b1-ckpt": f"{LORA},data.batch_size=1,model.activation_checkpointing=true",
    "lora-r16-b4": f"{LORA},data.batch_size=4",
    "lora-r16-b4-ckpt": f"{LORA},data.batch_size=4,model.activation_checkpointing=true",
    "full-b1": "data.batch_size=1",
    "full-b1-ckpt": "data.batch_size=1,model.activation_checkpointing=true",
    "full-b1-ckpt-adamw8bit": "data.batch_size=1,model.activation_checkpointing=true,optim.optimizer=adamw8bit",
    "full-b1-ckpt-paged-adamw8bit": "data.batch_size=1,model.activation_checkpointing=true,"
                                    "optim.optimizer=paged_adamw8bit",
    "full-b1-ckpt-ao-adamw8bit": "data.batch_size=1,model.activation_checkpointing=true,optim.optimizer=ao_adamw8bit",
    "full-b1-ckpt-fsdp-offload": "data.batch_size=1,model.activation_checkpointing=true,train.parallel=fsdp,"
                                 "train.fsdp_cpu_offload=true",
    "full-b1x4-ckpt-accum": "data.batch_size=1,train.grad_accum=4,model.activation_checkpointing=true",
    "full-b4-ckpt": "data.batch_size=4,model.activation_checkpointing=true",
    "sd35-large:lora-r16-b1": f"{LORA},data.batch_size=1",
    "sd35-large:lora-r16-b1-ckpt": f"{LORA},data.batch_size=1,model.activation_checkpointing=true",
}


def run_case(args: argparse.Namespace, name: str, sets: str) -> dict:
    """In the worker process: build the Trainer, warm up, time, report."""
    import torch
    import torch.distributed as dist
    from sd3cluster.config import load_config
    from sd3cluster.dist import Runtime
    from sd3cluster.errors import UserError
    from sd3cluster.models import forward_flops
    from sd3cluster.train import Trainer

    preset = name.split(":", 1)[0] if ":" in name else args.preset
    overrides = [s for s in sets.split(",") if s]
    cuda = args.device == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    result: dict = {"case": name, "preset": preset, "resolution": args.resolution, "sets": overrides}
    if cuda:
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        if name.endswith("@24g"):
            torch.cuda.set_per_process_memory_fraction(CARDS_GIB["24GB"] * 2**30 / total, device)
            result["memory_limit_gib"] = CARDS_GIB["24GB"]
    # One rank in a process group of its own: FSDP2 (and its CPU offload) needs one; DDP on one rank is skipped.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rt = Runtime(0, 1, 0, device, True)
    steps = args.warmup + args.steps
    try:
        cfg = load_config(None, [f"model.preset={preset}", f"data.resolution={args.resolution}",
                                 f"data.text_tokens={args.text_tokens}", f"train.precision={args.precision}",
                                 f"model.compile={str(args.compile).lower()}", "output.tensorboard=false",
                                 "output.progress=false", "output.dir=/tmp/sd3-memory-bench", *overrides])
        cfg.data.synthetic_samples = cfg.data.batch_size * cfg.train.grad_accum * steps
        trainer = Trainer(cfg, rt)
        result["trainable_parameters"] = sum(p.numel() for p in trainer.params)
        if cuda:
            # Random init draws the base in fp32 on the GPU before a LoRA run casts it to bf16; weights from
            # model.pretrained load in bf16 on the host instead, so that spike is the benchmark's, not a user's.
            # It is recorded apart and the training peak starts here (the base stays resident, so it counts).
            result["build_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.empty_cache()  # the freed fp32 blocks would stay reserved
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.warmup):
            trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            metrics = trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
        images = cfg.data.batch_size * cfg.train.grad_accum
        result.update(status="ok", step_s=seconds, images_per_s=images / seconds, loss=metrics["loss"],
                      global_batch=images)
        result["mfu"] = 3 * forward_flops(preset, 1, args.resolution, args.text_tokens) * images / seconds / (
            args.peak_tflops * 1e12)
    except torch.OutOfMemoryError as e:
        result.update(status="oom", error=str(e).splitlines()[0][:200])
    except (UserError, ImportError) as e:
        result.update(status="skip", error=str(e).splitlines()[0][:300])
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    else:
        import resource

        result["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    dist.destroy_process_group()
    return result


def fits(result: dict, context_gib: float) -> dict[str, bool | None]:
    if result.get("status") == "oom":
        return {card: False for card in CARDS_GIB} if "memory_limit_gib" not in result else {"24GB": False}
    peak = result.get("peak_reserved_gib")
    if result.get("status") != "ok" or peak is None:
        return {card: None for card in CARDS_GIB}
    return {card: peak + context_gib <= size for card, size in CARDS_GIB.items()}


def _num(result: dict, key: str, fmt: str) -> str:
    value = result.get(key)
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def table(results: list[dict], context_gib: float) -> str:
    lines = ["| case | status | trainable params | peak alloc GiB | peak reserved GiB | images/s | "
             + " | ".join(CARDS_GIB) + " |", "|---" * (6 + len(CARDS_GIB)) + "|"]
    for r in results:
        fit = fits(r, context_gib)
        marks = ["yes" if fit.get(c) else ("no" if fit.get(c) is False else "-") for c in CARDS_GIB]
        lines.append(f"| {r['case']} | {r.get('status')} | {_num(r, 'trainable_parameters', ',')} | "
                     f"{_num(r, 'peak_allocated_gib', '.1f')} | {_num(r, 'peak_reserved_gib', '.1f')} | "
                     f"{_num(r, 'images_per_s', '.2f')} | " + " | ".join(marks) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="sd3-medium")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--text-tokens", type=int, default=154)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda")
    parser.add_argument("--compile", action="store_true", help="torch.compile the blocks (model.compile)")
    parser.add_argument("--case", action="append", default=[], help="NAME=KEY=VALUE,KEY=VALUE (repeatable; "
                        "default: the built-in cases); NAME may start with PRESET: for another model")
    parser.add_argument("--only", default="", help="comma-separated names of built-in cases to run")
    parser.add_argument("--context-gib", type=float, default=1.0, help="memory torch does not count")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200 SXM)")
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per case")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "SETS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precision is None:
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    if args.worker:
        print(json.dumps(run_case(args, *args.worker)), flush=True)
        return 0
    cases = dict(c.split("=", 1) for c in args.case) if args.case else dict(DEFAULT_CASES)
    if args.only:
        cases = {k: v for k, v in cases.items() if k in args.only.split(",")}
    if args.preset == "tiny":  # the CPU smoke run: every case on the tiny model
        cases = {k.split(":", 1)[-1] + (" (" + k.split(":", 1)[0] + " as tiny)" if ":" in k else ""): v
                 for k, v in cases.items()}
    results = []
    passthrough = sys.argv[1:]
    for name, sets in cases.items():
        cmd = [sys.executable, __file__, *_strip(passthrough), "--worker", name, sets]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                "case": name, "status": "error", "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
        except subprocess.TimeoutExpired:
            result = {"case": name, "status": "timeout"}
        result["wall_s"] = time.perf_counter() - started
        result["fits"] = fits(result, args.context_gib)
        results.append(result)
        print(json.dumps(result), flush=True)
    report = table(results, args.context_gib)
    print(report)
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "context_gib": args.context_gib,
                                        "cards_gib": CARDS_GIB, "results": results, "table": report}, indent=2)
                            + "\n")
    return 0 if all(r.get("status") in ("ok", "skip", "oom") for r in results) else 1


def _strip(argv: list[str]) -> list[str]:
    """The parent's options for the worker, without those that name cases (the worker gets its one case)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--case", "--only", "--out"):
            skip = True
            continue
        if a.startswith(("--case=", "--only=", "--out=")):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
