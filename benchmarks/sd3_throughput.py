"""SD3 training throughput on one GPU: the diffusers-style reference loop and sd3cluster's variants, same run.

    python3 benchmarks/sd3_throughput.py --case sd3-medium:1024:8:reference --case sd3-medium:1024:8:optimized

A case is PRESET:RESOLUTION:BATCH:VARIANT (variant syntax in sd3cluster.bench); every case runs
`sd3cluster train`'s Trainer step. Run each case in its own process when comparing them (one call of this
script per case), so no case inherits another's compiled kernels or memory. MFU = FLOPs of one forward
pass of the diffusers model counted by torch.utils.flop_counter, x 3, / (--peak-tflops x step time).
`--sdpa` first times the attention kernels and the MLP's GEMM (bf16 and fp8) alone on SD3-medium's 1024^2
shape; `--profile-steps N` traces N more steps of every case once it is warm and prints the GPU time per step of
each kernel family (attention, GEMM, fused Triton kernels, optimizer, other) and the top kernels.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

if importlib.util.find_spec("sd3cluster") is None:  # a checkout's source, unless PYTHONPATH names another tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workloads" / "src"))

from cuda_timing import time_cuda
from sd3cluster.bench import BenchResult, Variant, format_table, run_variant
from sd3cluster.config import load_config


def sdpa_microbench(batch: int = 8, heads: int = 24, seq: int = 4250, head_dim: int = 64) -> list[str]:
    """Forward+backward of SDPA alone per backend, TFLOP/s counting 4*B*H*S^2*D forward and 2.5x that backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 4 * batch * heads * seq * seq * head_dim
    lines = []
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            with sdpa_kernel([backend]):
                fwd = time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
                both = time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(grad))
            lines.append(f"sdpa {name}: fwd {fwd * 1e3:.2f} ms = {fwd_flops / fwd / 1e12:.0f} TFLOP/s; fwd+bwd "
                         f"{both * 1e3:.2f} ms = {3.5 * fwd_flops / both / 1e12:.0f} TFLOP/s")
        except RuntimeError as e:
            lines.append(f"sdpa {name}: not available ({str(e).splitlines()[0][:100]})")
    from sd3cluster.attention import attention, fa4_import_problem

    if fa4_import_problem() is None:
        qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        grad_s = grad.transpose(1, 2).contiguous()
        fwd = time_cuda(lambda: attention(qs, ks, vs, "fa4"))
        both = time_cuda(lambda: attention(qs, ks, vs, "fa4").backward(grad_s))
        lines.append(f"fa4 (custom op): fwd {fwd * 1e3:.2f} ms = {fwd_flops / fwd / 1e12:.0f} TFLOP/s; fwd+bwd "
                     f"{both * 1e3:.2f} ms = {3.5 * fwd_flops / both / 1e12:.0f} TFLOP/s")
    else:
        lines.append(f"fa4: not available ({fa4_import_problem()})")
    a = torch.randn(batch * 4096, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 1536, device="cuda", dtype=torch.bfloat16)
    mm = time_cuda(lambda: a @ w.t())
    mm_flops = 2 * a.shape[0] * 1536 * 6144
    lines.append(f"matmul {a.shape[0]}x1536x6144 bf16: {mm_flops / mm / 1e12:.0f} TFLOP/s")
    a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    mm8 = time_cuda(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    lines.append(f"matmul {a.shape[0]}x1536x6144 fp8 e4m3 (tensorwise scales): {mm_flops / mm8 / 1e12:.0f} TFLOP/s")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", required=True, help="PRESET:RES:BATCH:VARIANT")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--text-tokens", type=int, default=154)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of H100/H200 SXM")
    parser.add_argument("--sdpa", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=0, help="trace this many warm steps of each case")
    parser.add_argument("--copy-ops", action="store_true",
                        help="trace one more warm step with the CPU ops and list its copy ops by input shape")
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the results")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    if args.sdpa:
        for line in sdpa_microbench():
            print(line, flush=True)
    results: list[BenchResult] = []
    for case in args.case:
        preset, res, batch, spec = case.split(":", 3)
        variant = Variant.parse(spec)
        base = load_config(overrides=[f"model.preset={preset}", f"data.resolution={res}", f"data.batch_size={batch}",
                                      f"data.text_tokens={args.text_tokens}", f"bench.steps={args.steps}",
                                      f"bench.warmup={args.warmup}", f"train.peak_tflops={args.peak_tflops}",
                                      "train.device=cuda"])
        t0 = time.perf_counter()
        try:
            r = run_variant(variant, base, device, profile_steps=args.profile_steps, trace_copies=args.copy_ops)
        except torch.OutOfMemoryError:
            print(f"[{case}] out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # one failing variant must not lose the others' numbers
            print(f"[{case}] failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            torch.cuda.empty_cache()
            continue
        results.append(r)
        print(f"[{case}] {r.images_per_s:.2f} images/s, MFU {r.mfu:.3f}, step {r.step_s * 1e3:.0f} ms, peak "
              f"{r.peak_gib:.1f} GiB, first step {r.compile_s:.0f} s (peak {r.first_step_peak_gib:.1f} GiB), "
              f"case {time.perf_counter() - t0:.0f} s; "
              f"{r.extra['kernels']}", flush=True)
        if "kernel_ms_per_step" in r.extra:
            print(f"[{case}] GPU ms per step by kernel family: {r.extra['kernel_ms_per_step']}", flush=True)
            print(r.extra["top_kernels"], flush=True)
        for row in r.extra.get("copy_ops", [])[:12]:
            print(f"[{case}] copy op {row['op']} x{row['calls']}: {row['device_ms']:.2f} ms (GPU, its kernels), "
                  f"shapes {row['shapes'][:120]}", flush=True)
        if args.out:
            args.out.write_text(json.dumps([asdict(x) for x in results], indent=2))
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
