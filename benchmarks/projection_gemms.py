"""The attention projections' GEMMs of an SD3 joint block: cuBLAS (torch) against quack, alone and at sustained load.

In the training step's trace (benchmarks/sd3_training.md run 18, an H100) the feed-forward's GEMMs, which run on quack,
reach about 755 TFLOP/s while the attention's q/k/v and output projections, which run on cuBLAS (torch.mm/addmm
in sd3cluster.row_blocks), reach about 690 at shapes of the same size (65 ms a step). This times each of those GEMMs
at SD3-medium's 1024^2 batch 8 shape, forward (q/k/v with its bias, the output projection without its bias, which
the fused norm adds), input gradient and weight gradient, for the image stream (8 x 4096 rows) and the context
stream (8 x 154 rows), with torch and with quack (tuned per shape as quack's own linear layer calls it, the weight
gradient's split over K left to its tuner where the output has fewer tiles than the card has SMs), and quack's
grouped form that runs both streams' GEMM of a kind in one launch (varlen_m: each stream's rows with its own
weight). Each case holds the load for about a second (`--seconds`) after a warm-up of as long, so the card sits at
its power limit as in a step. Every quack result is checked against torch's. GPU (sm90), with quack-kernels
and sd3cluster (workloads/src) importable, only:

    python3 benchmarks/projection_gemms.py [--batch 8] [--image-tokens 4096] [--context-tokens 154] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from cuda_timing import time_cuda


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-tokens", type=int, default=4096)
    parser.add_argument("--context-tokens", type=int, default=154)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--blocks", type=int, default=24, help="joint blocks a step, for the per-step totals")
    parser.add_argument("--seconds", type=float, default=1.0, help="how long each case holds the load")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from quack.gemm_interface import gemm
    from sd3cluster.row_blocks import weight_grad_fills_card

    torch.manual_seed(0)
    c, dev, bf16 = args.width, "cuda", torch.bfloat16
    streams = {"image": args.batch * args.image_tokens, "context": args.batch * args.context_tokens}
    t = {}
    for s, m in streams.items():  # a block's tensors, per stream, with weights like a trained model's (small)
        t[s] = {"x": torch.randn(m, c, device=dev, dtype=bf16), "a": torch.randn(m, c, device=dev, dtype=bf16),
                "dqkv": torch.randn(m, 3 * c, device=dev, dtype=bf16),
                "dy": torch.randn(m, c, device=dev, dtype=bf16),
                "wqkv": torch.randn(3 * c, c, device=dev, dtype=bf16) * 0.02,
                "bqkv": torch.randn(3 * c, device=dev, dtype=bf16) * 0.02,
                "wo": torch.randn(c, c, device=dev, dtype=bf16) * 0.02}
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def wgrad_split(rows_out: int, cols_out: int):
        # quack's linear does not split K; here its tuner may where the output alone cannot fill the card (the rule
        # model.projections keeps such a gradient on cuBLAS by)
        return 1 if weight_grad_fills_card((rows_out, cols_out), sms) else None

    def cases(s: str):
        v, m = t[s], streams[s]
        flops = {"qkv": 2 * m * c * 3 * c, "out": 2 * m * c * c}
        return [
            ("forward q/k/v + bias", flops["qkv"], lambda: torch.addmm(v["bqkv"], v["x"], v["wqkv"].t()),
             lambda: gemm(v["x"], v["wqkv"].T, bias=v["bqkv"], dynamic_scheduler=True)),
            ("forward output", flops["out"], lambda: torch.mm(v["a"], v["wo"].t()),
             lambda: gemm(v["a"], v["wo"].T, dynamic_scheduler=True)),
            ("input grad q/k/v", flops["qkv"], lambda: torch.mm(v["dqkv"], v["wqkv"]),
             lambda: gemm(v["dqkv"], v["wqkv"], dynamic_scheduler=True)),
            ("input grad output", flops["out"], lambda: torch.mm(v["dy"], v["wo"]),
             lambda: gemm(v["dy"], v["wo"], dynamic_scheduler=True)),
            ("weight grad q/k/v", flops["qkv"], lambda: v["dqkv"].t().mm(v["x"]),
             lambda: gemm(v["dqkv"].T, v["x"], dynamic_scheduler=True, split_k=wgrad_split(3 * c, c))),
            ("weight grad output", flops["out"], lambda: v["dy"].t().mm(v["a"]),
             lambda: gemm(v["dy"].T, v["a"], dynamic_scheduler=True, split_k=wgrad_split(c, c))),
        ]

    rows, totals = [], {}

    def timed(fn) -> float:
        once = time_cuda(fn, 3, 3)
        iters = max(20, int(args.seconds / max(once, 1e-6)))
        time_cuda(fn, iters, 0)  # the warm-up: the card reaches its power limit
        return time_cuda(fn, iters, 0) * 1e3

    def report(stream: str, name: str, kernel: str, ms: float, flops: float, err: float | None) -> None:
        ended = time.strftime("%H:%M:%S")
        tf = flops / ms / 1e9
        print(f"{ended} {stream:8s} {name:22s} {kernel:14s} {ms:7.3f} ms {tf:6.1f} TFLOP/s"
              + (f"  rel err {err:.1e}" if err is not None else ""), flush=True)
        rows.append({"stream": stream, "gemm": name, "kernel": kernel, "ms": ms, "tflops": tf, "ended": ended,
                     "rel_err_vs_torch": err})
        totals[kernel] = totals.get(kernel, 0.0) + ms * args.blocks  # each GEMM once a block

    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()

    for s in streams:
        for name, flops, torch_fn, quack_fn in cases(s):
            try:
                err = rel_err(quack_fn(), torch_fn())
                report(s, name, "torch", timed(torch_fn), flops, None)
                report(s, name, "quack", timed(quack_fn), flops, err)
            except Exception as e:  # a quack configuration that fails here is a result, not a crash
                print(f"{s} {name}: quack failed: {type(e).__name__}: {e}", flush=True)
                rows.append({"stream": s, "gemm": name, "kernel": "quack", "failed": f"{type(e).__name__}: {e}"})
    # both streams' GEMM of one kind in one launch: rows [image; context], each block of rows with its own weight
    img, ctx = t["image"], t["context"]
    m1, m2 = streams["image"], streams["context"]
    cu = torch.tensor([0, m1, m1 + m2], device=dev, dtype=torch.int32)
    x_all = torch.cat([img["x"], ctx["x"]])
    a_all, dqkv_all = torch.cat([img["a"], ctx["a"]]), torch.cat([img["dqkv"], ctx["dqkv"]])
    wqkv_t = torch.stack([img["wqkv"].T, ctx["wqkv"].T])  # (2, in, out)
    b_all = torch.stack([img["bqkv"], ctx["bqkv"]])
    wo_t, wqkv_s = torch.stack([img["wo"].T, ctx["wo"].T]), torch.stack([img["wqkv"], ctx["wqkv"]])
    grouped = [
        ("forward q/k/v + bias", 2 * (m1 + m2) * c * 3 * c,
         lambda: torch.cat([torch.addmm(img["bqkv"], img["x"], img["wqkv"].t()),
                            torch.addmm(ctx["bqkv"], ctx["x"], ctx["wqkv"].t())]),
         lambda: gemm(x_all, wqkv_t, bias=b_all, cu_seqlens_m=cu, dynamic_scheduler=True)),
        ("forward output", 2 * (m1 + m2) * c * c,
         lambda: torch.cat([torch.mm(img["a"], img["wo"].t()), torch.mm(ctx["a"], ctx["wo"].t())]),
         lambda: gemm(a_all, wo_t, cu_seqlens_m=cu, dynamic_scheduler=True)),
        ("input grad q/k/v", 2 * (m1 + m2) * c * 3 * c,
         lambda: torch.cat([torch.mm(img["dqkv"], img["wqkv"]), torch.mm(ctx["dqkv"], ctx["wqkv"])]),
         lambda: gemm(dqkv_all, wqkv_s, cu_seqlens_m=cu, dynamic_scheduler=True)),
    ]
    for name, flops, torch_fn, quack_fn in grouped:
        try:
            err = rel_err(quack_fn(), torch_fn())
            report("both", name, "quack grouped", timed(quack_fn), flops, err)
        except Exception as e:
            print(f"both {name}: quack grouped failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"stream": "both", "gemm": name, "kernel": "quack grouped",
                         "failed": f"{type(e).__name__}: {e}"})
    print("a step's attention-projection GEMMs, both streams, " + ", ".join(
        f"{k}: {v:.1f} ms" for k, v in totals.items() if k != "quack grouped"), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
