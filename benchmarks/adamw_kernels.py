"""One optimizer step of SD3-medium's parameters alone: torch's clip_grad_norm_ + fused AdamW, or sd3cluster's
Triton AdamW (optim.kernel), one of them per process. GPU only:

    PYTHONPATH=workloads/src python3 benchmarks/adamw_kernels.py --kernel torch|triton [--preset sd3-medium]
        [--configs 4096x4,8192x8]   # triton: chunk size x warps of a program, each timed (the first is the result)

fp32 parameters of the preset's shapes (built on the meta device, then allocated on the GPU), random gradients,
clip at 1.0. Prints the step's time and its rate against the bytes it must move at least: the update reads the
parameter, gradient and two moments and writes three of them (28 bytes a parameter), the norm reads the gradient
(4 more). The gradients are not freed between steps (the training step allocates them afresh, mostly at the
same addresses), so the pointer tables are sent once, as in training.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from cuda_timing import time_cuda

BYTES_PER_PARAMETER = 28 + 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("torch", "triton"), required=True)
    parser.add_argument("--preset", default="sd3-medium")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--configs", default="", help="triton: CHUNKxWARPS,... to time besides the module's own")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("adamw_kernels.py measures GPU kernels; this machine has no CUDA device", file=sys.stderr)
        return 2
    from sd3cluster.fused_adamw import TritonAdamW
    from sd3cluster.models import build_transformer

    shapes = [p.shape for p in build_transformer(args.preset, device="meta").parameters()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    count = sum(p.numel() for p in params)
    configs: list[dict] = []
    if args.kernel == "triton":
        from sd3cluster import fused_adamw

        own = (fused_adamw.CHUNK, fused_adamw.NUM_WARPS)
        for chunk, warps in [own] + [tuple(map(int, c.split("x"))) for c in args.configs.split(",") if c]:
            fused_adamw.CHUNK, fused_adamw.NUM_WARPS = chunk, warps
            opt = TritonAdamW(params, lr=1e-4, weight_decay=1e-4)
            configs.append({"chunk": chunk, "warps": warps,
                            "seconds": time_cuda(lambda opt=opt: opt.step(max_norm=1.0), iters=args.iters)})
            del opt
            torch.cuda.empty_cache()
        fused_adamw.CHUNK, fused_adamw.NUM_WARPS = own
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4, fused=True)

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        configs.append({"seconds": time_cuda(step, iters=args.iters)})
    for c in configs:
        c["step_ms"], c["tb_per_s"] = round(c["seconds"] * 1e3, 3), round(
            count * BYTES_PER_PARAMETER / c["seconds"] / 1e12, 3)
        shape = f" chunk {c['chunk']} x {c['warps']} warps" if "chunk" in c else ""
        print(f"{args.kernel}{shape}: {len(params)} tensors, {count:,} parameters: {c['step_ms']:.2f} ms a step "
              f"(norm, clip and update), {c['tb_per_s']:.2f} TB/s of the {BYTES_PER_PARAMETER} bytes a parameter "
              "it must move")
    result = {"kernel": args.kernel, "preset": args.preset, "parameters": count, "tensors": len(params),
              "step_ms": configs[0]["step_ms"], "tb_per_s": configs[0]["tb_per_s"], "configs": configs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
