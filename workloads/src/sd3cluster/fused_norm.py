"""adaLN-Zero's LayerNorm and modulation (with the gated residual before it) as one Triton kernel each way, and the
gated residual after the feed-forward as another.

Every SD3 joint block normalises its two streams twice: `y = LayerNorm(x) * (1 + scale) + shift` with a shift
and scale per sample, and before the second norm `x = x + gate * attention_output`. Compiled by Inductor that is a
two-pass reduction over each 1536-wide row in the forward, and in the backward a LayerNorm gradient plus separate
reductions over the tokens for the shift, scale and gate gradients, each reading the activations again. Here the
forward reads a row once and writes the residual, the normalised row and its statistics; the backward reads each
row once, writes dx (and the branch's gradient) and keeps the per-sample sums of its rows in registers; the ops
hand back those partial sums and the autograd formulas add them up, so that in a compiled backward Inductor does it
in the kernel that also casts them and forms the gate's and bias's gradients (not in a reduce launch per norm).
The block's last update, `x + gate * feed_forward_output`, is `gated_residual`, whose backward likewise writes the
branch's gradient and sums the gate's as it goes.

The output projections of the attention and of the feed-forward leave their biases to these kernels (the residual
adds `gate * (branch + bias)`): the bias's gradient is the sum of the branch's gradient over tokens and samples,
which the kernels sum in the pass that writes it, where the projection's backward would read that whole gradient
once more for it (the attention output bias's sum alone took 0.74 ms a step of SD3-medium at 1024^2 on an H200,
benchmarks/sd3_training.md run 16).

The kernels run on CUDA (and on the CPU under Triton's interpreter, TRITON_INTERPRET=1, which the tests use). Each
is a PyTorch custom op with its backward, so torch.compile keeps a block in one graph around them.

Measured on an H200 (benchmarks/sd3_training.md, run 12): an SD3-medium training step 0.5-0.8% faster than with
Inductor's kernels in the compiled block; in the step's kernel trace the fused kernels run at about 80% of the rate
their least memory traffic allows (forward and backward of all norms: 14.6 ms a step).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import nn

from .errors import UserError
from .kernel_choice import choose_kernel, triton_import_problem
from .models import (
    feed_forward_deferring_out_bias,
    joint_attention_sequence_first,
    linear_compute_dtype,
    sequence_first_backend,
)


def backward_rows(rows: int) -> int:
    """Rows of one sample that one backward program walks through and sums over: 32 where there are enough rows
    to fill an H100/H200 with such programs (SD3's 4096 image tokens x batch 8: 1024 programs) and few partial
    sums to add up afterwards; 8 for short streams (the 154 text tokens), which would otherwise run on few SMs."""
    return 32 if rows >= 16384 else 8


def backward_parts(batch: int, tokens: int) -> int:
    """The backward programs along one sample's tokens, each writing one partial sum per plane."""
    return -(-tokens // backward_rows(batch * tokens))


def _partial(planes: int, x: torch.Tensor, seq_first: bool) -> torch.Tensor:
    """An uninitialised (planes, batch, parts, channels) fp32 tensor for a backward kernel's partial sums."""
    batch, tokens, channels = _dims(x, seq_first)
    return x.new_empty((planes, batch, backward_parts(batch, tokens), channels), dtype=torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
    """The kernels, defined on first use so that importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def triton_adaln_forward(X, BRANCH, GATE, BIAS, SHIFT, SCALE, H, Y, MEAN, RSTD, tokens, samples, channels,
                             mod_stride, eps, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, SEQ_FIRST: tl.constexpr,
                             BLOCK_C: tl.constexpr):
        row = tl.program_id(0)
        # rows in (batch, tokens) order, or (tokens, batch) for the sequence-first layout
        sample = row % samples if SEQ_FIRST else row // tokens
        cols = tl.arange(0, BLOCK_C)
        mask = cols < channels
        offsets = row.to(tl.int64) * channels + cols
        mod = sample * mod_stride + cols
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            branch = tl.load(BRANCH + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                branch += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(GATE + mod, mask=mask, other=0.0).to(tl.float32)
            x = x + gate * branch
            tl.store(H + offsets, x.to(H.dtype.element_ty), mask=mask)
        mean = tl.sum(x, axis=0) / channels
        centered = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / channels + eps)
        shift = tl.load(SHIFT + mod, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(SCALE + mod, mask=mask, other=0.0).to(tl.float32)
        y = centered * rstd * (1.0 + scale) + shift
        tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def triton_adaln_backward(X, BRANCH, GATE, BIAS, SCALE, DY, DH, MEAN, RSTD, DX, DBRANCH, PARTIAL, tokens,
                              channels, mod_stride, parts, samples, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_DH: tl.constexpr, SEQ_FIRST: tl.constexpr, BLOCK_C: tl.constexpr,
                              ROWS: tl.constexpr):
        sample = tl.program_id(0)
        part = tl.program_id(1)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < channels
        mod = sample * mod_stride + cols
        scale = tl.load(SCALE + mod, mask=cmask, other=0.0).to(tl.float32)
        gate = tl.zeros([BLOCK_C], dtype=tl.float32)
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
        if GATED:
            gate = tl.load(GATE + mod, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)
        sum_dx = tl.zeros([BLOCK_C], dtype=tl.float32)
        sum_dy = tl.zeros([BLOCK_C], dtype=tl.float32)
        sum_dy_xhat = tl.zeros([BLOCK_C], dtype=tl.float32)
        sum_dh_branch = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r in range(ROWS):
            token = part * ROWS + r
            valid = token < tokens
            mask = cmask & valid
            row = token * samples + sample if SEQ_FIRST else sample * tokens + token
            offsets = row.to(tl.int64) * channels + cols
            x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
            branch = tl.zeros([BLOCK_C], dtype=tl.float32)
            if GATED:
                branch = tl.load(BRANCH + offsets, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    branch = tl.where(mask, branch + bias, 0.0)
                x = x + gate * branch
            mean = tl.load(MEAN + row, mask=valid, other=0.0)
            rstd = tl.load(RSTD + row, mask=valid, other=0.0)
            xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
            sum_dy += dy
            sum_dy_xhat += dy * xhat
            dxhat = dy * (1.0 + scale)
            mean_dxhat = tl.sum(dxhat, axis=0) / channels
            mean_dxhat_xhat = tl.sum(dxhat * xhat, axis=0) / channels
            dx = (dxhat - mean_dxhat - xhat * mean_dxhat_xhat) * rstd
            if HAS_DH:
                dx += tl.load(DH + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
            if GATED:
                tl.store(DBRANCH + offsets, (dx * gate).to(DBRANCH.dtype.element_ty), mask=mask)
                sum_dh_branch += dx * branch
                sum_dx += dx
        # PARTIAL is (3 or 4, samples, parts, channels): the shift, scale and gate gradients of this program's rows,
        # and with a bias the sum of dx (the bias's gradient is that times the gate, summed over the samples).
        out = (sample * parts + part).to(tl.int64) * channels + cols
        plane = samples * parts * channels
        tl.store(PARTIAL + out, sum_dy, mask=cmask)
        tl.store(PARTIAL + plane + out, sum_dy_xhat, mask=cmask)
        if GATED:
            tl.store(PARTIAL + 2 * plane + out, sum_dh_branch, mask=cmask)
        if HAS_BIAS:
            tl.store(PARTIAL + 3 * plane + out, sum_dx, mask=cmask)

    @triton.jit
    def triton_gated_residual_forward(H, BRANCH, GATE, BIAS, OUT, tokens, samples, channels, mod_stride,
                                      HAS_BIAS: tl.constexpr, SEQ_FIRST: tl.constexpr, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)
        sample = row % samples if SEQ_FIRST else row // tokens
        cols = tl.arange(0, BLOCK_C)
        mask = cols < channels
        offsets = row.to(tl.int64) * channels + cols
        branch = tl.load(BRANCH + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            branch += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(GATE + sample * mod_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offsets, (h + gate * branch).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def triton_gated_residual_backward(DOUT, BRANCH, GATE, DBRANCH, PARTIAL, tokens, channels, mod_stride, parts,
                                       samples, SEQ_FIRST: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr):
        sample = tl.program_id(0)
        part = tl.program_id(1)
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < channels
        gate = tl.load(GATE + sample * mod_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        sum_dout = tl.zeros([BLOCK_C], dtype=tl.float32)
        sum_dout_branch = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r in range(ROWS):
            token = part * ROWS + r
            mask = cmask & (token < tokens)
            row = token * samples + sample if SEQ_FIRST else sample * tokens + token
            offsets = row.to(tl.int64) * channels + cols
            dout = tl.load(DOUT + offsets, mask=mask, other=0.0).to(tl.float32)
            branch = tl.load(BRANCH + offsets, mask=mask, other=0.0).to(tl.float32)
            sum_dout += dout
            sum_dout_branch += dout * branch
            tl.store(DBRANCH + offsets, (dout * gate).to(DBRANCH.dtype.element_ty), mask=mask)
        # PARTIAL is (2, samples, parts, channels): this program's sums of dout and of dout * branch
        out = (sample * parts + part).to(tl.int64) * channels + cols
        tl.store(PARTIAL + out, sum_dout, mask=cmask)
        tl.store(PARTIAL + samples * parts * channels + out, sum_dout_branch, mask=cmask)

    return (triton_adaln_forward, triton_adaln_backward, triton_gated_residual_forward,
            triton_gated_residual_backward)


def _launch_options(channels: int) -> dict[str, int]:
    import triton

    block = triton.next_power_of_2(channels)
    return {"BLOCK_C": block, "num_warps": 8 if block >= 2048 else 4 if block >= 512 else 1}


def _dims(x: torch.Tensor, seq_first: bool) -> tuple[int, int, int]:
    """(batch, tokens, channels) of x, which is (batch, tokens, channels), or (tokens, batch, channels) when
    seq_first."""
    return (x.shape[1], x.shape[0], x.shape[2]) if seq_first else tuple(x.shape)


def _check(x: torch.Tensor, shift: torch.Tensor, seq_first: bool) -> None:
    layout = "(tokens, batch, channels)" if seq_first else "(batch, tokens, channels)"
    if x.dim() != 3 or shift.dim() != 2 or shift.shape != (_dims(x, seq_first)[0], x.shape[2]):
        raise ValueError(f"adaLN expects x {layout} and shift/scale/gate (batch, channels); got "
                         f"{tuple(x.shape)} and {tuple(shift.shape)}")


def _per_sample(*mods: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], int]:
    """The per-sample shift/scale/gate rows as the kernels read them, and their row stride: as given where they
    share one row stride and their channels are adjacent (the chunks of the modulation's output, as the joint blocks
    pass them: 18 small copies a block a step saved), else contiguous copies."""
    if all(m.stride(1) == 1 for m in mods) and len({m.stride(0) for m in mods}) == 1:
        return mods, mods[0].stride(0)
    return tuple(m.contiguous() for m in mods), mods[0].shape[1]


def _forward(x: torch.Tensor, branch: torch.Tensor | None, gate: torch.Tensor | None, bias: torch.Tensor | None,
             shift: torch.Tensor, scale: torch.Tensor, eps: float, out_dtype: torch.dtype, seq_first: bool = False):
    _check(x, shift, seq_first)
    batch, tokens, channels = _dims(x, seq_first)
    x = x.contiguous()
    gated = branch is not None
    h = torch.empty_like(x) if gated else x
    y = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    mean = torch.empty((batch * tokens,), device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    (gate, shift, scale), mod_stride = _per_sample(gate if gated else shift, shift, scale)
    forward_kernel = _kernels()[0]
    forward_kernel[(batch * tokens,)](x, branch.contiguous() if gated else x, gate, bias if bias is not None else gate,
                                      shift, scale, h, y, mean, rstd, tokens, batch, channels, mod_stride, eps,
                                      GATED=gated, HAS_BIAS=bias is not None, SEQ_FIRST=seq_first,
                                      **_launch_options(channels))
    return h, y, mean, rstd


def _backward(dy: torch.Tensor, dh: torch.Tensor | None, x: torch.Tensor, branch: torch.Tensor | None,
              gate: torch.Tensor | None, bias: torch.Tensor | None, scale: torch.Tensor, mean: torch.Tensor,
              rstd: torch.Tensor, seq_first: bool = False):
    batch, tokens, channels = _dims(x, seq_first)
    gated = branch is not None
    rows = backward_rows(batch * tokens)
    x, dy = x.contiguous(), dy.contiguous()  # the kernel walks rows of `channels` elements
    branch = branch.contiguous() if gated else None
    dx = torch.empty_like(x)
    dbranch = torch.empty_like(branch) if gated else dx
    partial = _partial(2 + gated + (bias is not None), x, seq_first)
    parts = partial.shape[2]
    (gate, scale), mod_stride = _per_sample(gate if gated else scale, scale)
    backward_kernel = _kernels()[1]
    backward_kernel[(batch, parts)](x, branch if gated else x, gate, bias if bias is not None else scale, scale, dy,
                                    dh.contiguous() if dh is not None else dy, mean, rstd,
                                    dx, dbranch, partial, tokens, channels, mod_stride, parts, batch, GATED=gated,
                                    HAS_BIAS=bias is not None, HAS_DH=dh is not None, SEQ_FIRST=seq_first, ROWS=rows,
                                    **_launch_options(channels))
    return dx, dbranch, partial


def _residual_forward(h: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                      seq_first: bool) -> torch.Tensor:
    _check(h, gate, seq_first)
    batch, tokens, channels = _dims(h, seq_first)
    h, branch = h.contiguous(), branch.contiguous()
    out = torch.empty_like(h)
    (gate,), mod_stride = _per_sample(gate)
    _kernels()[2][(batch * tokens,)](h, branch, gate, bias if bias is not None else gate, out, tokens, batch,
                                     channels, mod_stride, HAS_BIAS=bias is not None, SEQ_FIRST=seq_first,
                                     **_launch_options(channels))
    return out


def _residual_backward(dout: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor,
                       seq_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch, tokens, channels = _dims(branch, seq_first)
    rows = backward_rows(batch * tokens)
    dout, branch = dout.contiguous(), branch.contiguous()
    dbranch = torch.empty_like(branch)
    partial = _partial(2, branch, seq_first)
    parts = partial.shape[2]
    (gate,), mod_stride = _per_sample(gate)
    _kernels()[3][(batch, parts)](dout, branch, gate, dbranch, partial, tokens, channels, mod_stride, parts, batch,
                                  SEQ_FIRST=seq_first, ROWS=rows, **_launch_options(channels))
    return dbranch, partial


# -- custom ops ---------------------------------------------------------------------------------------------------

@torch.library.custom_op("sd3cluster::adaln", mutates_args=())
def adaln_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, out_dtype: torch.dtype,
             seq_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): y = LayerNorm(x) * (1 + scale) + shift in out_dtype; the row statistics for the backward.
    seq_first: x is (tokens, batch, channels)."""
    _, y, mean, rstd = _forward(x, None, None, None, shift, scale, eps, out_dtype, seq_first)
    return y, mean, rstd


@torch.library.custom_op("sd3cluster::gated_adaln", mutates_args=())
def gated_adaln_op(x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                   shift: torch.Tensor, scale: torch.Tensor, eps: float, out_dtype: torch.dtype,
                   seq_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, y, mean, rstd): h = x + gate * (branch + bias) (x's dtype; bias per channel or None), y = adaLN of h as
    in adaln_op."""
    return _forward(x, branch, gate, bias, shift, scale, eps, out_dtype, seq_first)


@torch.library.custom_op("sd3cluster::adaln_backward", mutates_args=())
def adaln_backward_op(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                      rstd: torch.Tensor, seq_first: bool,
                      dh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, partial): partial (2, batch, parts, channels) fp32 holds dshift's and dscale's partial sums over tokens
    (see _summed). dh: a gradient of x from elsewhere, added to dx in the same pass (fused_norm_pass puts the
    residual's there)."""
    dx, _, partial = _backward(dy, dh, x, None, None, None, scale, mean, rstd, seq_first)
    return dx, partial


@torch.library.custom_op("sd3cluster::gated_adaln_backward", mutates_args=())
def gated_adaln_backward_op(dh: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, branch: torch.Tensor,
                            gate: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor, mean: torch.Tensor,
                            rstd: torch.Tensor, seq_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dbranch, partial): dx = dh + the norm's gradient (x, h and the residual share it); partial (3, batch,
    parts, channels) fp32 holds the partial sums of dshift, dscale and dgate, with a bias (4, ...) and those of dx
    last."""
    return _backward(dy, dh, x, branch, gate, bias, scale, mean, rstd, seq_first)


@torch.library.custom_op("sd3cluster::gated_residual", mutates_args=())
def gated_residual_op(h: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                      seq_first: bool) -> torch.Tensor:
    """h + gate * (branch + bias), in h's dtype; gate per sample (batch, channels), bias per channel or None."""
    return _residual_forward(h, branch, gate, bias, seq_first)


@torch.library.custom_op("sd3cluster::gated_residual_backward", mutates_args=())
def gated_residual_backward_op(dout: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor,
                               seq_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dbranch, partial): dbranch = gate * dout; partial (2, batch, parts, channels) fp32 holds the partial sums over
    tokens of dout and of dout * branch, from which the gate's and the bias's gradients follow."""
    return _residual_backward(dout, branch, gate, seq_first)


@gated_residual_op.register_fake
def _(h, branch, gate, bias, seq_first):
    return h.new_empty(h.shape)


@gated_residual_backward_op.register_fake
def _(dout, branch, gate, seq_first):
    return branch.new_empty(branch.shape), _partial(2, branch, seq_first)


def _summed(partial: torch.Tensor) -> torch.Tensor:
    """The per-sample sums over tokens, (planes, batch, channels), from a backward kernel's partial sums. Outside the
    custom ops so that a compiled backward sums them in the kernel that also casts them and computes what follows
    from them (the gate's and the bias's gradients), not in a reduce launch of its own (one per norm, 144 a step of
    SD3-medium)."""
    return partial.sum(dim=2)


def _bias_gradient(gate: torch.Tensor, sum_over_tokens: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The gradient of a bias added inside `gate * (branch + bias)`: the incoming gradient's per-sample sums over
    tokens (batch, channels), times the gate, summed over the samples."""
    return (gate.float() * sum_over_tokens).sum(0).to(bias.dtype)


def _residual_setup(ctx, inputs, output) -> None:
    _h, branch, gate, bias, ctx.seq_first = inputs
    ctx.save_for_backward(branch, gate, bias)
    ctx.has_bias = bias is not None


def _residual_backward_autograd(ctx, dout):
    branch, gate, bias = ctx.saved_tensors
    dbranch, partial = gated_residual_backward_op(dout, branch, gate, ctx.seq_first)
    sums = _summed(partial)
    sum_dout, sum_dout_branch = sums[0], sums[1]
    # d gate = sum_t dout * (branch + bias); d bias = sum over samples and tokens of gate * dout
    dgate = sum_dout_branch + bias.float() * sum_dout if ctx.has_bias else sum_dout_branch
    dbias = _bias_gradient(gate, sum_dout, bias) if ctx.has_bias else None
    return dout, dbranch, dgate.to(gate.dtype), dbias, None


gated_residual_op.register_autograd(_residual_backward_autograd, setup_context=_residual_setup)


def _stats(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0] * x.shape[1],), dtype=torch.float32)


@adaln_op.register_fake
def _(x, shift, scale, eps, out_dtype, seq_first):
    return x.new_empty(x.shape, dtype=out_dtype), _stats(x), _stats(x)


@gated_adaln_op.register_fake
def _(x, branch, gate, bias, shift, scale, eps, out_dtype, seq_first):
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=out_dtype), _stats(x), _stats(x)


@adaln_backward_op.register_fake
def _(dy, x, scale, mean, rstd, seq_first, dh=None):
    return x.new_empty(x.shape), _partial(2, x, seq_first)


@gated_adaln_backward_op.register_fake
def _(dh, dy, x, branch, gate, bias, scale, mean, rstd, seq_first):
    return x.new_empty(x.shape), branch.new_empty(branch.shape), _partial(3 + (bias is not None), x, seq_first)


def _adaln_setup(ctx, inputs, output) -> None:
    x, shift, scale, _eps, _dtype, ctx.seq_first = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, scale, mean, rstd)
    ctx.dtypes = (shift.dtype, scale.dtype)
    ctx.mark_non_differentiable(mean, rstd)


def _adaln_backward(ctx, dy, _dmean, _drstd):
    x, scale, mean, rstd = ctx.saved_tensors
    dx, partial = adaln_backward_op(dy, x, scale, mean, rstd, ctx.seq_first)
    sums = _summed(partial)
    return dx, sums[0].to(ctx.dtypes[0]), sums[1].to(ctx.dtypes[1]), None, None, None


def _gated_setup(ctx, inputs, output) -> None:
    x, branch, gate, bias, shift, scale, _eps, _dtype, ctx.seq_first = inputs
    _, _, mean, rstd = output
    ctx.save_for_backward(x, branch, gate, bias, scale, mean, rstd)
    ctx.dtypes = (gate.dtype, shift.dtype, scale.dtype)
    ctx.mark_non_differentiable(mean, rstd)


def _gated_backward(ctx, dh, dy, _dmean, _drstd):
    x, branch, gate, bias, scale, mean, rstd = ctx.saved_tensors
    dx, dbranch, partial = gated_adaln_backward_op(dh, dy, x, branch, gate, bias, scale, mean, rstd, ctx.seq_first)
    sums = _summed(partial)
    gate_dtype, shift_dtype, scale_dtype = ctx.dtypes
    # the bias's gradient: the branch's (gate * dx) summed over tokens and samples
    dbias = _bias_gradient(gate, sums[3], bias) if bias is not None else None
    return (dx, dbranch, sums[2].to(gate_dtype), dbias, sums[0].to(shift_dtype), sums[1].to(scale_dtype), None,
            None, None)


adaln_op.register_autograd(_adaln_backward, setup_context=_adaln_setup)
gated_adaln_op.register_autograd(_gated_backward, setup_context=_gated_setup)


def adaln(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
          seq_first: bool = False) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift (no affine parameters; shift and scale per sample), in the dtype its
    consumer uses. x is (batch, tokens, channels), or (tokens, batch, channels) when seq_first."""
    return adaln_op(x, shift, scale, eps, linear_compute_dtype(x), seq_first)[0]


def gated_adaln(x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                scale: torch.Tensor, eps: float, seq_first: bool = False,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, adaln(h, shift, scale)) with h = x + gate * (branch + bias): the residual update and the next norm. The
    bias is the attention's output projection's where the block leaves it here: its gradient is summed in the pass
    that writes the branch's, where the projection's backward would read the whole branch gradient again."""
    h, y, _, _ = gated_adaln_op(x, branch, gate, bias, shift, scale, eps, linear_compute_dtype(x), seq_first)
    return h, y


def gated_residual(h: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None = None,
                   seq_first: bool = False) -> torch.Tensor:
    """h + gate * (branch + bias): the joint blocks' residual update after the feed-forward, whose output projection
    leaves its bias to this op. One pass each way: the backward writes the branch's gradient and sums what the
    gate's and the bias's gradients need as it goes (Inductor's kernels read the stream three times for these, and
    the bias's gradient once more)."""
    return gated_residual_op(h, branch, gate, bias, seq_first)


# -- the joint block ----------------------------------------------------------------------------------------------


def resolve_norm(name: str, device: torch.device) -> tuple[str, str]:
    """(kind, why) for model.norm: triton (the fused kernels) or torch (diffusers' modules, compiled or not).
    auto takes triton on CUDA when it imports."""
    return choose_kernel("model.norm", name, "triton", "fused adaLN LayerNorm + modulation + gated residual",
                         lambda: "not a CUDA device" if device.type != "cuda" else triton_import_problem())


def _plain_zero_norm(module: nn.Module) -> bool:
    """diffusers' AdaLayerNormZero with a plain LayerNorm (no affine) and its six-way modulation."""
    from diffusers.models.normalization import AdaLayerNormZero

    norm = getattr(module, "norm", None)
    return (type(module) is AdaLayerNormZero and module.emb is None and type(norm) is nn.LayerNorm
            and not norm.elementwise_affine)


def _plain_layer_norm(module: nn.Module) -> bool:
    return type(module) is nn.LayerNorm and not module.elementwise_affine


def _modulation(norm: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return norm.linear(norm.silu(temb)).chunk(6, dim=1)


def _stream(x: torch.Tensor, mods: tuple[torch.Tensor, ...], norm1_eps: float, seq_first: bool) -> torch.Tensor:
    shift_msa, scale_msa = mods[0], mods[1]
    return adaln(x, shift_msa, scale_msa, norm1_eps, seq_first)


def _after_attention(x: torch.Tensor, attn_out: torch.Tensor, attn_bias: torch.Tensor | None,
                     mods: tuple[torch.Tensor, ...], norm2: nn.LayerNorm, ff: nn.Module,
                     seq_first: bool) -> torch.Tensor:
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
    h, y = gated_adaln(x, attn_out, gate_msa, shift_mlp, scale_mlp, norm2.eps, seq_first, attn_bias)
    branch, bias = feed_forward_deferring_out_bias(ff, y)
    return gated_residual(h, branch, gate_mlp, bias, seq_first)


def _relayout(x: torch.Tensor, seq_first_from: bool, seq_first_to: bool) -> torch.Tensor:
    """A stream from one layout into the other: into (tokens, batch, channels) a contiguous copy (a block's input,
    or its result for a chained next block); into (batch, tokens, channels) a transposed view, which diffusers'
    modules and the batch-first kernels take as it is."""
    if seq_first_from == seq_first_to:
        return x
    return x.transpose(0, 1).contiguous() if seq_first_to else x.transpose(0, 1)


def chain_sequence_first(blocks: nn.ModuleList) -> int:
    """Between two consecutive sequence-first blocks the streams stay (tokens, batch, channels) contiguous tensors,
    so nothing is transposed at a block's edge. A transposed view handed across comes back in the backward as a
    gradient of the other layout, copied at the block's edge and again in the norm's backward (about 7 ms a step
    for SD3-medium at 1024^2 on an H100, benchmarks/sd3_training.md run 14). Only the first block of a chain takes
    (batch, tokens, channels) and only the last returns it. Returns how many links were made."""
    chain = [hasattr(b, "sequence_first_chain") and sequence_first_backend(b.attn) is not None for b in blocks]
    links = 0
    for i, block in enumerate(blocks):
        if chain[i]:
            takes = i > 0 and chain[i - 1]
            hands = i + 1 < len(blocks) and chain[i + 1]
            block.sequence_first_chain = (takes, hands)
            links += hands
    return links


_CHAIN_BREAKERS = ("block_controlnet_hidden_states", "skip_layers")


def _refuse_chain_breakers(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook of a model whose blocks are chained sequence-first: skipped blocks (SD3.5's skip-layer
    guidance) and ControlNet residuals (added between blocks) would meet a stream in the other layout."""
    import inspect

    given = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    breakers = [name for name in _CHAIN_BREAKERS if given.get(name) is not None]
    if breakers:
        raise UserError(f"{', '.join(breakers)} cannot be given to a model whose joint blocks run sequence-first "
                        "(model.layout=sequence keeps the streams (tokens, batch, channels) between blocks); set "
                        "model.layout=batch")


def fuse_norms(model: nn.Module) -> int:
    """Run the adaLN norms of every joint block that has the plain layout (both streams modulated six ways, no
    second attention, no chunked feed-forward) through the fused kernels on CUDA; others, and any call off CUDA
    (unless TRITON_INTERPRET=1, under which the tests run the kernels on the CPU), keep diffusers' forward.
    Parameters and their names are unchanged. Consecutive sequence-first blocks of a block list (fuse_qkv's
    sequence_first, applied before) are chained (chain_sequence_first), and the list's owner refuses the forward
    arguments that would break the chain. Returns how many blocks were fused."""
    from diffusers.models.attention import JointTransformerBlock

    class FusedNormJointBlock(JointTransformerBlock):
        sequence_first_chain = (False, False)  # (takes, hands) (tokens, batch, channels): chain_sequence_first

        def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                    joint_attention_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            if not (hidden_states.is_cuda or _interpreting()):
                return super().forward(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
            img = _modulation(self.norm1, temb)
            txt = _modulation(self.norm1_context, temb)
            backend = sequence_first_backend(self.attn)
            # Sequence-first, the streams run as (tokens, batch, channels) and the q/k/v of both share one packed
            # tensor; chained to its neighbours (chain_sequence_first) a block takes and hands that layout as is.
            seq_first = backend is not None and not joint_attention_kwargs
            seq_first_in, seq_first_out = self.sequence_first_chain
            hidden_states = _relayout(hidden_states, seq_first_in, seq_first)
            encoder_hidden_states = _relayout(encoder_hidden_states, seq_first_in, seq_first)
            normed_img = _stream(hidden_states, img, self.norm1.norm.eps, seq_first)
            normed_txt = _stream(encoder_hidden_states, txt, self.norm1_context.norm.eps, seq_first)
            bias_img = bias_txt = None  # the output projections' biases where the residual update adds them
            if seq_first:
                attn_img, attn_txt, bias_img, bias_txt = joint_attention_sequence_first(self.attn, normed_img,
                                                                                        normed_txt, backend)
            else:
                attn_img, attn_txt = self.attn(hidden_states=normed_img, encoder_hidden_states=normed_txt,
                                               **(joint_attention_kwargs or {}))
            hidden_states = _after_attention(hidden_states, attn_img, bias_img, img, self.norm2, self.ff, seq_first)
            encoder_hidden_states = _after_attention(encoder_hidden_states, attn_txt, bias_txt, txt,
                                                     self.norm2_context, self.ff_context, seq_first)
            return (_relayout(encoder_hidden_states, seq_first, seq_first_out),
                    _relayout(hidden_states, seq_first, seq_first_out))

    fused = 0
    for module in model.modules():
        if type(module) is not JointTransformerBlock or module.use_dual_attention or module.context_pre_only:
            continue
        if module._chunk_size is not None or not (_plain_zero_norm(module.norm1)
                                                  and _plain_zero_norm(module.norm1_context)
                                                  and _plain_layer_norm(module.norm2)
                                                  and _plain_layer_norm(module.norm2_context)):
            continue
        module.__class__ = FusedNormJointBlock
        fused += 1
    if fused:
        from . import fused_norm_pass

        fused_norm_pass.install()  # compiled blocks: the first norm's backward adds the residual's gradient
    for parent in list(model.modules()):
        lists = [child for child in parent.children() if isinstance(child, nn.ModuleList)]
        if sum(chain_sequence_first(blocks) for blocks in lists) and not getattr(parent, "_sd3_chain_guard", False):
            parent.register_forward_pre_hook(_refuse_chain_breakers, with_kwargs=True)
            parent._sd3_chain_guard = True
    return fused
