"""sd3cluster's fused adaLN kernels at SD3-medium's image-stream shape under several launch configurations.

`fused_norm` launches its backward with 32 rows per program and 8 warps, its forward with one row per program and
8 warps (`backward_rows`, `_launch_options`); in a training step's kernel table (run 19, an H100) the image
stream's backward kernels moved about 60% of the bytes the card's bandwidth allows, the forward's about 75%. This
times the raw kernels (no autograd, no custom-op dispatch) at 1024^2 batch 8 in the sequence-first layout the step
uses (4096 tokens x 8 samples x 1536 channels, bf16 stream and branch), for the plain norm (norm1: its dx plus the
residual's gradient) and the gated one (norm2: also the branch and its bias), under each candidate, with every
output compared with the default's (benchmarks/sd3_training.md, run 20). GPU only:

    PYTHONPATH=workloads/src python3 benchmarks/adaln_kernel_configs.py [--batch 8] [--tokens 4096] [--out r.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from cuda_timing import time_cuda

BACKWARD_ROWS = (16, 32, 64)
WARPS = (4, 8, 16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=1536)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from sd3cluster import fused_norm

    forward, backward = fused_norm._kernels()[:2]
    b, n, c = args.batch, args.tokens, args.channels
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=bf16, generator=gen)

    x, branch, dy, dh = rand(n, b, c), rand(n, b, c), rand(n, b, c), rand(n, b, c)
    mods = rand(b, 3 * c)  # gate, shift, scale as the chunks of one modulation output, as the blocks pass them
    gate, shift, scale = mods[:, :c], mods[:, c:2 * c], mods[:, 2 * c:]
    bias = rand(c)
    launch = fused_norm._launch_options(c)  # the default launch: BLOCK_C and num_warps
    block_c, default_warps = launch["BLOCK_C"], launch["num_warps"]
    element = b * n * c
    results, failed = [], 0

    def close(got, want):  # bf16 outputs whose row sums are added in another order
        return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))

    def stats(gated):
        h, y = torch.empty_like(x), torch.empty_like(x)
        mean = torch.empty(b * n, device=dev, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        forward[(b * n,)](x, branch, gate, bias, shift, scale, h, y, mean, rstd, n, b, c, mods.stride(0), 1e-6,
                          GATED=gated, HAS_BIAS=gated, SEQ_FIRST=True, **launch)
        return h, y, mean, rstd

    for gated in (False, True):
        name = "norm2 (gated, bias)" if gated else "norm1"
        # least traffic (bf16 = 2 B): forward reads x (and the branch), writes y (and h); backward reads x, dy, dh
        # (and the branch), writes dx (and dbranch)
        forward_bytes = element * 2 * (4 if gated else 2)
        backward_bytes = element * 2 * (6 if gated else 4)
        _, y_default, mean, rstd = stats(gated)
        for warps in WARPS:
            h, y = torch.empty_like(x), torch.empty_like(x)
            m, r = torch.empty_like(mean), torch.empty_like(rstd)

            def fwd(w=warps, h=h, y=y, m=m, r=r, g=gated):
                forward[(b * n,)](x, branch, gate, bias, shift, scale, h, y, m, r, n, b, c, mods.stride(0), 1e-6,
                                  GATED=g, HAS_BIAS=g, SEQ_FIRST=True, BLOCK_C=block_c, num_warps=w)

            seconds = time_cuda(fwd, iters=50, warmup=3)
            same = close(y, y_default)
            failed += not same
            results.append({"kernel": f"{name} forward", "warps": warps, "ms": seconds * 1e3,
                            "gb_s": forward_bytes / seconds / 1e9, "matches_default": same})
            print(f"{name:20s} forward  warps {warps:2d}            {seconds * 1e3:7.3f} ms "
                  f"{forward_bytes / seconds / 1e9:6.0f} GB/s{'' if same else '  DIFFERS from the default'}",
                  flush=True)
        default = None
        for rows, warps in itertools.product(BACKWARD_ROWS, WARPS):
            parts = -(-n // rows)
            dx, dbranch = torch.empty_like(x), torch.empty_like(x)
            partial = torch.empty((4 if gated else 2, b, parts, c), device=dev, dtype=torch.float32)

            def bwd(rows=rows, w=warps, dx=dx, dbranch=dbranch, partial=partial, parts=parts, g=gated,
                    mean=mean, rstd=rstd):
                backward[(b, parts)](x, branch, gate, bias, scale, dy, dh, mean, rstd, dx, dbranch, partial, n, c,
                                     mods.stride(0), parts, b, GATED=g, HAS_BIAS=g, HAS_DH=True, SEQ_FIRST=True,
                                     BLOCK_C=block_c, ROWS=rows, num_warps=w)

            label = f"{name:20s} backward rows {rows:2d} warps {warps:2d}"
            try:
                seconds = time_cuda(bwd, iters=50, warmup=3)
            except Exception as e:  # a configuration the compiler refuses (registers) is a line, not the end
                print(f"{label} failed: {type(e).__name__}: {e}"[:300], flush=True)
                continue
            outs = (dx, dbranch, partial.sum(2))  # dbranch is written only by the gated kernel
            if default is None or (rows, warps) == (fused_norm.backward_rows(b * n), default_warps):
                default = outs  # the default launch's (the first's until it comes)
            results.append({"kernel": f"{name} backward", "rows": rows, "warps": warps,
                            "ms": seconds * 1e3, "gb_s": backward_bytes / seconds / 1e9, "outputs": outs})
            print(f"{label} {seconds * 1e3:7.3f} ms {backward_bytes / seconds / 1e9:6.0f} GB/s", flush=True)
        # every configuration's outputs against the default's (the same rows' sums, added in another order)
        for result in results:
            outs = result.pop("outputs", None)
            if outs is not None:
                planes = 4 if gated else 2
                same = close(outs[0], default[0]) and (not gated or close(outs[1], default[1])) and close(
                    outs[2][:planes], default[2][:planes])
                result["matches_default"] = same
                failed += not same
                if not same:
                    print(f"{name} backward rows {result['rows']} warps {result['warps']}: DIFFERS from the default")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
