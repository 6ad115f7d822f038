"""Text-to-image speed of SD3: diffusers' StableDiffusion3Pipeline as its docs use it against sd3cluster's pipeline.

Each variant runs in its own process (one after the other, same GPU, same call), on the same random-weight
components built in code (SD3-medium transformer, CLIP-L, CLIP-G, T5-XXL, the 16-channel VAE: nothing is
downloaded). Measured per variant: the latency of one image (p50 and p90 over --latency-runs, after warm-up),
and images/s at each batch of --batches (the mean of --batch-runs calls). Times are host clock around the whole
pipeline call (text encoding, denoising, VAE decode, conversion to uint8/PIL), the device synchronised.

    python3 benchmarks/sd3_generation.py --out result.json       # diffusers, then ours (= generate --compile)
    python3 benchmarks/sd3_generation.py --variants diffusers,ours-eager,ours --tokens 333

The compute floor printed beside the numbers: 2 x steps forward passes of the transformer, FLOPs counted by
torch's FlopCounterMode on the meta device, at the dense bf16 peak (989 TFLOP/s on H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "a photo of a red house in the snow at night"
STAGES: list[tuple[int, float, float, float]] = []  # (batch, encode, denoise, decode seconds) of our pipeline


def _sync():
    import torch

    torch.cuda.synchronize()


def _build(variant: str, t5_tokens: int):
    import torch
    from sd3cluster.components import random_encoders
    from sd3cluster.models import build_transformer

    device, dtype = torch.device("cuda"), torch.bfloat16
    enc = random_encoders("sd3-medium", device=device, dtype=dtype)
    transformer = build_transformer("sd3-medium", device=device).to(dtype)
    if variant.startswith("ours"):
        from sd3cluster.pipeline import SD3Pipeline

        compiled = variant == "ours"  # what `sd3cluster generate --compile` runs: blocks and VAE decoder
        pipe = SD3Pipeline(transformer, enc, device, dtype, t5_tokens=t5_tokens, compile_blocks=compiled,
                           compile_vae=compiled)

        def call(batch: int, size: int, steps: int, guidance: float, seed: int):
            images, times = pipe([PROMPT] * batch, list(range(seed, seed + batch)), size, size, steps, guidance)
            STAGES.append((batch, times.encode, times.denoise, times.decode))
            return images

        return call
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=enc.vae,
        text_encoder=enc.clip_l, tokenizer=enc.tok_l, text_encoder_2=enc.clip_g, tokenizer_2=enc.tok_g,
        text_encoder_3=enc.t5, tokenizer_3=enc.tok_t5).to(device, dtype)
    pipe.set_progress_bar_config(disable=True)

    def call(batch: int, size: int, steps: int, guidance: float, seed: int):
        generator = [torch.Generator("cuda").manual_seed(seed + i) for i in range(batch)]
        return pipe(PROMPT, negative_prompt="", num_images_per_prompt=batch, height=size, width=size,
                    num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=t5_tokens,
                    generator=generator).images

    return call


def run_variant(args: argparse.Namespace) -> dict:
    import torch

    start = time.perf_counter()
    call = _build(args.variant, args.t5_tokens)
    build_s = time.perf_counter() - start
    result: dict = {"variant": args.variant, "build_s": build_s, "size": args.size, "steps": args.steps,
                    "guidance": args.guidance, "text_tokens": 77 + args.t5_tokens}

    def timed(batch: int, seed: int) -> float:
        _sync()
        t0 = time.perf_counter()
        images = call(batch, args.size, args.steps, args.guidance, seed)
        _sync()
        assert len(images) == batch
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    warm = [timed(1, 0) for _ in range(args.warmup)]
    result["warmup_s"] = warm
    result["first_call_s"] = warm[0] if warm else None
    latencies = [timed(1, 100 + i) for i in range(args.latency_runs)]
    result["latency_s"] = latencies
    result["p50_s"] = statistics.median(latencies)
    result["p90_s"] = sorted(latencies)[max(0, round(0.9 * len(latencies)) - 1)]
    throughput = {1: 1.0 / statistics.mean(latencies)}
    for batch in args.batches:
        if batch == 1:
            continue
        timed(batch, 1000)  # a new batch shape: its own warm-up (and compilation)
        runs = [timed(batch, 2000 + 10 * i) for i in range(args.batch_runs)]
        throughput[batch] = batch / statistics.mean(runs)
    result["images_per_s"] = {str(k): v for k, v in throughput.items()}
    best = max(throughput, key=throughput.get)
    result["best_batch"], result["best_images_per_s"] = best, throughput[best]
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["measure_s"] = time.perf_counter() - t0
    ones = [s for s in STAGES[args.warmup:args.warmup + args.latency_runs] if s[0] == 1]
    if ones:
        result["stages_batch1_s"] = {name: statistics.median(s[i] for s in ones)
                                     for i, name in ((1, "encode"), (2, "denoise"), (3, "decode"))}
    return result


def compute_floor(size: int, steps: int, text_tokens: int) -> dict:
    from sd3cluster.models import forward_flops

    flops = forward_flops("sd3-medium", 1, size, text_tokens)
    per_image = 2 * steps * flops
    return {"forward_tflop": flops / 1e12, "tflop_per_image": per_image / 1e12,
            "floor_s_at_peak": per_image / 989e12}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="diffusers,ours")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # the child process's own variant
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--guidance", type=float, default=7.0)
    parser.add_argument("--tokens", type=int, default=154, choices=[154, 333],
                        help="text tokens: 77 CLIP + 77 or 256 T5")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--latency-runs", type=int, default=10)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--batch-runs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.t5_tokens = args.tokens - 77
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
        return 0
    results = {"floor": compute_floor(args.size, args.steps, args.tokens), "variants": {}}
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", variant, "--size", str(args.size), "--steps", str(args.steps),
               "--guidance", str(args.guidance), "--tokens", str(args.tokens), "--warmup", str(args.warmup),
               "--latency-runs", str(args.latency_runs), "--batches", ",".join(map(str, args.batches)),
               "--batch-runs", str(args.batch_runs)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
        if proc.returncode != 0:
            print(f"{variant} failed:\n{proc.stderr[-4000:]}", flush=True)
            results["variants"][variant] = {"error": proc.stderr[-2000:]}
            continue
        results["variants"][variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results["variants"][variant]
        print(f"{variant:>9}: p50 {r['p50_s']:.3f} s/image (p90 {r['p90_s']:.3f}), images/s by batch "
              f"{ {k: round(v, 3) for k, v in r['images_per_s'].items()} }, best {r['best_images_per_s']:.3f} at "
              f"batch {r['best_batch']}, first call {r['first_call_s']:.1f} s, peak {r['peak_memory_gib']:.1f} GiB",
              flush=True)
        if "stages_batch1_s" in r:
            print(f"{'':>9}  stages at batch 1 (median s): {r['stages_batch1_s']}", flush=True)
    floor = results["floor"]
    print(f"floor: {floor['tflop_per_image']:.1f} TFLOP per image = {floor['floor_s_at_peak']:.3f} s at 989 TFLOP/s")
    v = results["variants"]
    if "p50_s" in v.get("ours", {}) and "p50_s" in v.get("diffusers", {}):
        results["speedup_best_images_per_s"] = v["ours"]["best_images_per_s"] / v["diffusers"]["best_images_per_s"]
        results["speedup_p50"] = v["diffusers"]["p50_s"] / v["ours"]["p50_s"]
        results["ours_p50_over_floor"] = v["ours"]["p50_s"] / floor["floor_s_at_peak"]
        print(f"ours vs diffusers: {results['speedup_best_images_per_s']:.2f}x images/s at the best batch, "
              f"{results['speedup_p50']:.2f}x p50 latency; ours p50 / floor = {results['ours_p50_over_floor']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
