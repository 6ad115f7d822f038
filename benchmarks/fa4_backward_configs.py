"""FlashAttention-4's Hopper backward at SD3's attention shape, under several tile configurations.

flash-attn-4 picks its sm90 backward tiles in `interface._tile_size_bwd_sm90` (taken from FA3's C++ launch
template, tuned on H100 at other shapes). This times each candidate at SD3-medium's 1024^2 shape (batch 8,
24 heads, 4250 tokens, head_dim 64, bf16, non-causal) and checks its gradients against the default's, so a
faster configuration can be kept only when it is also right. GPU (sm90) only:

    python3 benchmarks/fa4_backward_configs.py [--batch 8] [--tokens 4250] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from cuda_timing import time_cuda

# name -> changes to the default hdim-64 configuration (interface.BwdConfig fields)
CANDIDATES: dict[str, dict] = {
    "default": {},
    "SdP_noswap": dict(SdP_swapAB=False, AtomLayoutMSdP=2),
    "dKV_swap": dict(dKV_swapAB=True),
    "dQ_swap": dict(dQ_swapAB=True),
    "atom_dQ1": dict(AtomLayoutMdQ=1),
    "atom_dKV1": dict(AtomLayoutNdKV=1),
    "m64": dict(m_block_size=64, AtomLayoutMdQ=1),
    "m64_dQ1wg": dict(m_block_size=64, AtomLayoutMdQ=1, dQ_single_wg=True),
    "n96": dict(n_block_size=96),
    "stagesPdS1": dict(num_stages_PdS=1),
    "wg3_m192": dict(m_block_size=192, num_wg=3, AtomLayoutNdKV=3, AtomLayoutMdQ=3),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4250)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--only", action="append", help="run these candidates only")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from flash_attn.cute import interface

    original = interface._tile_size_bwd_sm90
    torch.manual_seed(0)
    shape = (args.batch, args.tokens, args.heads, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out, lse, *_ = interface._flash_attn_fwd(q, k, v, return_lse=True)
    fwd_flops = 4 * args.batch * args.heads * args.tokens**2 * 64
    bwd_flops = 2.5 * fwd_flops
    reference = None
    rows = []
    for name, change in CANDIDATES.items():
        if args.only and name not in args.only:
            continue
        config = dataclasses.replace(original(64, 64, False, False), **change)
        interface._tile_size_bwd_sm90 = lambda *a, _c=config, **kw: _c
        try:
            grads = interface._flash_attn_bwd(q, k, v, out, dout, lse)
            ms = time_cuda(lambda: interface._flash_attn_bwd(q, k, v, out, dout, lse), args.iters, warmup=1) * 1e3
        except Exception as e:  # a configuration the kernel cannot build at this shape
            print(f"{name:12s} failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}", flush=True)
            rows.append({"name": name, "change": change, "error": f"{type(e).__name__}: {e}"[:500]})
            continue
        finally:
            interface._tile_size_bwd_sm90 = original
        if reference is None:
            reference = [g.float() for g in grads]
        error = max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, reference, strict=True))
        tflops = bwd_flops / ms / 1e9
        print(f"{name:12s} {ms:6.3f} ms  {tflops:6.1f} TFLOP/s  grad rel. diff vs default {error:.2e}", flush=True)
        rows.append({"name": name, "change": change, "ms": ms, "tflops": tflops, "rel_diff": error})
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
