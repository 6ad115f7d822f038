"""FlashAttention-4 at SD3's attention shape: the memory layout of q/k/v it reads, and its forward's tiles.

The training step's FA4 calls took 2.00 ms forward and 4.74 ms backward a block inside an H200 step (the sequence-
first packed layout, benchmarks/sd3_training.md run 16) against 1.67 and 4.20 alone on contiguous tensors (run 12).
This times, alone and in one process, forward and backward of:
- `contiguous`: q, k, v, out and their gradients as separate (batch, tokens, heads, head_dim) tensors;
- `packed`: the step's layout, q/k/v interleaved in one (tokens, batch, 3, heads, head_dim) tensor read and written
  through strided views (sd3cluster.attention.fa4_attention_packed);
- `packed batch-first`: q/k/v interleaved in one (batch, tokens, 3, heads, head_dim) tensor (a token's rows 3x
  closer than contiguous ones, 8x closer than the step's), which tells whether the step's token stride costs;
- the backward with one part of the step's layout at a time (q/k/v read packed but the gradients written into
  separate contiguous tensors, or into separate sequence-first ones; contiguous q/k/v with the output and its
  gradient sequence-first), which tells what of the packed backward's cost comes from reading, from writing, and
  from the output's layout, and the copy that separate gradients would need to reach the packed layout;
- the step's layout with each (token, sample) row padded (`--pads`), which tells whether its power-of-two token
  stride costs;
- the forward and the backward each right after the GEMM that precedes it in the step, less that GEMM's time alone,
  which tells whether a GEMM before it (its clock, the L2 it leaves) slows the kernel as the step's trace shows;
and the forward at other tile sizes than flash-attn-4's hdim-64 choice (192 x 128) on the packed layout, each
checked against the default's output. Every case runs 400 calls back to back (`--iters`): the kernels draw the card
to its power limit within about a second, and the clock it then holds, not the boost clock of a short burst, is the
one a training step runs at (run 18: an H100 at 700 W held 1,500 to 1,700 MHz against 1,980 idle). GPU (sm90) only:

    python3 benchmarks/fa4_layouts.py [--batch 8] [--tokens 4250] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from cuda_timing import time_cuda

FWD_TILES = [(192, 128), (128, 128), (192, 192), (128, 192), (192, 96)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4250)
    parser.add_argument("--heads", type=int, default=24)
    # 400 calls hold the load for 0.7 to 2 s a case: long enough for the card to reach its power limit and the clock
    # it keeps there, as inside a training step (run 18: 30 calls read the boost clock, 8% faster than the step)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--pads", type=int, nargs="*", default=[],
                        help="elements to pad each (token, sample) row of the packed layout by, one case each "
                             "(run 18: 64 and 8 were slower)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    torch.manual_seed(0)
    b, n, h = args.batch, args.tokens, args.heads
    fwd_flops = 4 * b * h * n**2 * 64
    packed = torch.randn(n, b, 3, h, 64, device="cuda", dtype=torch.bfloat16)
    views = [packed[:, :, i].transpose(0, 1) for i in range(3)]  # (b, n, h, d) strided
    separate = [t.contiguous() for t in views]
    dout_seq = torch.randn(n, b, h, 64, device="cuda", dtype=torch.bfloat16)
    out_seq = torch.empty_like(dout_seq)
    dpacked = torch.empty_like(packed)
    dviews = [dpacked[:, :, i].transpose(0, 1) for i in range(3)]
    rows = []

    def report(name: str, ms: float, flops: float, **extra) -> None:
        ended = time.strftime("%H:%M:%S")  # to find the case in a clock and power log (sd3_training_gpu.sh keeps one)
        print(f"{ended} {name:36s} {ms:6.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
        rows.append({"name": name, "ms": ms, "tflops": flops / ms / 1e9, "ended": ended, **extra})

    # contiguous: the layout of run 12's isolated timing
    out_c, lse_c, *_ = _flash_attn_fwd(*separate, return_lse=True)
    dout_c = dout_seq.transpose(0, 1).contiguous()
    report("forward contiguous", time_cuda(lambda: _flash_attn_fwd(*separate, return_lse=True), args.iters) * 1e3,
           fwd_flops)
    report("backward contiguous",
           time_cuda(lambda: _flash_attn_bwd(*separate, out_c, dout_c, lse_c), args.iters) * 1e3, 2.5 * fwd_flops)
    # packed: the training step's layout
    _, lse_p, *_ = _flash_attn_fwd(*views, out=out_seq.transpose(0, 1), return_lse=True)
    torch.testing.assert_close(out_seq.transpose(0, 1), out_c)
    report("forward packed",
           time_cuda(lambda: _flash_attn_fwd(*views, out=out_seq.transpose(0, 1), return_lse=True), args.iters) * 1e3,
           fwd_flops)
    report("backward packed", time_cuda(lambda: _flash_attn_bwd(*views, out_seq.transpose(0, 1),
                                                                dout_seq.transpose(0, 1), lse_p, dq=dviews[0],
                                                                dk=dviews[1], dv=dviews[2]), args.iters) * 1e3,
           2.5 * fwd_flops)
    # the packed backward's cost, part by part
    grads_c = [torch.empty_like(t) for t in separate]
    report("backward packed, grads contiguous",
           time_cuda(lambda: _flash_attn_bwd(*views, out_seq.transpose(0, 1), dout_seq.transpose(0, 1), lse_p,
                                             dq=grads_c[0], dk=grads_c[1], dv=grads_c[2]), args.iters) * 1e3,
           2.5 * fwd_flops)
    report("backward contiguous, out seq-first",
           time_cuda(lambda: _flash_attn_bwd(*separate, out_seq.transpose(0, 1), dout_seq.transpose(0, 1), lse_p,
                                             dq=grads_c[0], dk=grads_c[1], dv=grads_c[2]), args.iters) * 1e3,
           2.5 * fwd_flops)
    # what writing the gradients elsewhere would cost the step: each gradient its own sequence-first tensor (the
    # token stride of one gradient, not three), and the copy that would then put the three into the packed layout
    # the q/k/v projection's backward reads
    grads_seq = [torch.empty_like(dout_seq) for _ in range(3)]
    report("backward packed, grads seq-first",
           time_cuda(lambda: _flash_attn_bwd(*views, out_seq.transpose(0, 1), dout_seq.transpose(0, 1), lse_p,
                                             dq=grads_seq[0].transpose(0, 1), dk=grads_seq[1].transpose(0, 1),
                                             dv=grads_seq[2].transpose(0, 1)), args.iters) * 1e3, 2.5 * fwd_flops)
    report("copy of 3 seq-first grads into packed",
           time_cuda(lambda: torch.stack(grads_seq, dim=2, out=dpacked), args.iters) * 1e3, 0.0)
    # packed sequence-first with each (token, sample) row padded: the step's token stride, 8 x 3 x 24 x 64 x 2 bytes
    # = 72 KiB, is a multiple of 8 KiB, so a tile's rows may fall on few of the memory's channels or L2 sets; a row
    # padded by `pad` elements breaks that power of two. Reads and gradients both padded, as a padded projection would.
    for pad in args.pads:
        row = 3 * h * 64 + pad
        strides = (b * row, row, h * 64, 64, 1)
        padded = torch.empty(n * b * row, device="cuda", dtype=torch.bfloat16).as_strided(packed.shape, strides)
        padded.copy_(packed)
        dpadded = torch.empty(n * b * row, device="cuda", dtype=torch.bfloat16).as_strided(packed.shape, strides)
        views_p = [padded[:, :, i].transpose(0, 1) for i in range(3)]
        dviews_p = [dpadded[:, :, i].transpose(0, 1) for i in range(3)]
        out_p = torch.empty_like(out_seq)
        _, lse_pp, *_ = _flash_attn_fwd(*views_p, out=out_p.transpose(0, 1), return_lse=True)
        torch.testing.assert_close(out_p, out_seq)
        report(f"forward packed, rows padded {pad}",
               time_cuda(lambda v=views_p, o=out_p: _flash_attn_fwd(*v, out=o.transpose(0, 1), return_lse=True),
                         args.iters) * 1e3, fwd_flops, pad=pad)
        report(f"backward packed, rows padded {pad}",
               time_cuda(lambda v=views_p, o=out_p, lse=lse_pp, d=dviews_p: _flash_attn_bwd(
                   *v, o.transpose(0, 1), dout_seq.transpose(0, 1), lse, dq=d[0], dk=d[1], dv=d[2]),
                   args.iters) * 1e3, 2.5 * fwd_flops, pad=pad)
    # packed batch-first: interleaved like the step's, with the contiguous layout's order of tokens and samples
    packed_b = packed.transpose(0, 1).contiguous()
    views_b = [packed_b[:, :, i] for i in range(3)]
    dpacked_b = torch.empty_like(packed_b)
    dviews_b = [dpacked_b[:, :, i] for i in range(3)]
    out_b = torch.empty_like(out_c)
    _, lse_b, *_ = _flash_attn_fwd(*views_b, out=out_b, return_lse=True)
    torch.testing.assert_close(out_b, out_c)
    report("forward packed batch-first",
           time_cuda(lambda: _flash_attn_fwd(*views_b, out=out_b, return_lse=True), args.iters) * 1e3, fwd_flops)
    report("backward packed batch-first", time_cuda(lambda: _flash_attn_bwd(*views_b, out_b, dout_c, lse_b,
                                                                            dq=dviews_b[0], dk=dviews_b[1],
                                                                            dv=dviews_b[2]), args.iters) * 1e3,
           2.5 * fwd_flops)
    # the forward and backward right after the GEMM that comes before each in the step (the q/k/v projection writing
    # the packed tensor; the output projection's input gradient): the pair's time less the GEMM's alone. More than
    # the kernel's own time is what a GEMM leaves behind (its clock under load, the L2 it filled), run 17's reading
    # of the step's 20% slower forward.
    x = torch.randn(n * b, h * 64, device="cuda", dtype=torch.bfloat16)
    w_qkv = torch.randn(3 * h * 64, h * 64, device="cuda", dtype=torch.bfloat16) / 40
    w_out = torch.randn(h * 64, h * 64, device="cuda", dtype=torch.bfloat16) / 40
    flat_packed, flat_dout = packed.view(n * b, 3 * h * 64), dout_seq.view(n * b, h * 64)
    gemm_qkv = time_cuda(lambda: torch.mm(x, w_qkv.t(), out=flat_packed), args.iters) * 1e3
    gemm_out = time_cuda(lambda: torch.mm(x, w_out, out=flat_dout), args.iters) * 1e3
    pair_fwd = time_cuda(lambda: (torch.mm(x, w_qkv.t(), out=flat_packed),
                                  _flash_attn_fwd(*views, out=out_seq.transpose(0, 1), return_lse=True)),
                         args.iters) * 1e3
    _, lse_p, *_ = _flash_attn_fwd(*views, out=out_seq.transpose(0, 1), return_lse=True)  # of the GEMM's q/k/v
    pair_bwd = time_cuda(lambda: (torch.mm(x, w_out, out=flat_dout),
                                  _flash_attn_bwd(*views, out_seq.transpose(0, 1), dout_seq.transpose(0, 1), lse_p,
                                                  dq=dviews[0], dk=dviews[1], dv=dviews[2])), args.iters) * 1e3
    report("forward packed, after its GEMM", pair_fwd - gemm_qkv, fwd_flops, gemm_ms=gemm_qkv)
    report("backward packed, after its GEMM", pair_bwd - gemm_out, 2.5 * fwd_flops, gemm_ms=gemm_out)
    # the forward's tiles on the packed layout
    reference = out_seq.float()
    for tile in FWD_TILES:
        out_t = torch.empty_like(out_seq)
        name = f"forward packed tile {tile[0]}x{tile[1]}"
        try:
            _flash_attn_fwd(*views, out=out_t.transpose(0, 1), return_lse=True, tile_mn=tile)
            ms = time_cuda(lambda t=tile, o=out_t: _flash_attn_fwd(*views, out=o.transpose(0, 1), return_lse=True,
                                                                   tile_mn=t), args.iters) * 1e3
        except Exception as e:  # a tile the kernel cannot build at this head size
            print(f"{name:36s} failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}", flush=True)
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"[:500]})
            continue
        diff = ((out_t.float() - reference).norm() / reference.norm()).item()
        report(name, ms, fwd_flops, rel_diff=diff)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
