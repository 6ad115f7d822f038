"""The adaLN norms of one SD3 joint block's image stream alone: Inductor's kernels against sd3cluster's fused ones.

Times, at SD3-medium's 1024^2 shape (batch 8, 4096 tokens, 1536 channels; fp32 residual stream, bf16 branch and
modulation as under autocast), forward and forward + backward of
  norm1: y = LayerNorm(x) * (1 + scale) + shift
  norm2: h = x + gate * branch; y = LayerNorm(h) * (1 + scale) + shift
once as the PyTorch expression compiled by torch.compile and once through sd3cluster.fused_norm, and the bytes
each must move at least, as a rate against the GPU's memory bandwidth. GPU only:

    PYTHONPATH=workloads/src python3 benchmarks/adaln_kernels.py [--tokens 4096] [--batch 8]

Each call goes through Python (the custom ops' dispatch and autograd, torch.compile's guards) against kernels of
0.1-0.2 ms, so these times include the host's share (benchmarks/sd3_training.md, run 12); the profiler's kernel
table of a training step (the GPU runner's `split` part) is what ranks the kernels.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from cuda_timing import time_cuda


def torch_norm1(x, shift, scale):
    return (F.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]).to(torch.bfloat16)


def torch_norm2(x, branch, gate, shift, scale):
    h = x + gate[:, None] * branch
    return h, torch_norm1(h, shift, scale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=1536)
    args = parser.parse_args()
    from sd3cluster.fused_norm import adaln, gated_adaln

    b, n, c = args.batch, args.tokens, args.channels
    dev = torch.device("cuda")
    x = torch.randn(b, n, c, device=dev, requires_grad=True)
    branch = torch.randn(b, n, c, device=dev, dtype=torch.bfloat16, requires_grad=True)
    mods = [torch.randn(b, c, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    gate, shift, scale = mods
    dy = torch.randn(b, n, c, device=dev, dtype=torch.bfloat16)
    dh = torch.randn(b, n, c, device=dev)
    compiled1, compiled2 = torch.compile(torch_norm1), torch.compile(torch_norm2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cases = {
            "norm1 torch.compile": (lambda: compiled1(x, shift, scale), lambda y: (y,), 1),
            "norm1 fused": (lambda: adaln(x, shift, scale, 1e-6), lambda y: (y,), 1),
            "norm2 torch.compile": (lambda: compiled2(x, branch, gate, shift, scale), lambda r: r[::-1], 2),
            "norm2 fused": (lambda: gated_adaln(x, branch, gate, shift, scale, 1e-6), lambda r: r[::-1], 2),
        }
        element = b * n * c
        for name, (forward, outputs, kind) in cases.items():
            fwd = time_cuda(lambda f=forward: f(), iters=30) * 1e3

            def step(f=forward, o=outputs, k=kind):
                outs = o(f())
                grads = (dy,) if k == 1 else (dy, dh)
                inputs = [x, shift, scale] if k == 1 else [x, branch, gate, shift, scale]
                torch.autograd.grad(outs, inputs, grads)  # no accumulation into .grad, which both would pay

            both = time_cuda(step, iters=30) * 1e3
            # least traffic: norm1 fwd reads x (4 B) writes y (2), bwd reads x, dy, writes dx (4+2+4);
            # norm2 fwd also reads the branch (2) and writes h (4); bwd reads dh (4) and the branch, writes dbranch
            least = element * ((6 + 10) if kind == 1 else (12 + 18))
            print(f"{name:22s} forward {fwd:6.3f} ms   forward+backward {both:6.3f} ms   "
                  f"{least / both / 1e6:6.0f} GB/s of least traffic", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
