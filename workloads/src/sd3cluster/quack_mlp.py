"""The joint blocks' feed-forward as quack GEMMs whose epilogues also take the first bias's gradient.

quack's `mlp_func` runs `out(gelu_tanh(proj(x)))` with the GELU in the first GEMM's epilogue and the GELU's gradient
in the epilogue of the backward's first GEMM; the first bias's gradient is then a sum over the rows of that GEMM's
output (`dpreact.sum(0)`), a kernel that reads the 4x-wide hidden gradient once more: 403 MB a block for
SD3-medium's image stream at 1024^2 batch 8, 2.2 ms of an H200 step (benchmarks/sd3_training.md run 16). Here the
backward's GEMM is quack's `dgelu_dbias_mod` epilogue, which sums each column of the GELU's gradient as it writes
it. The output projection's bias is left to the caller (fused_norm.gated_residual adds it and sums its gradient in
the same pass).

Both directions are custom ops, opaque to torch.compile, so quack runs as in eager mode inside them: its GEMMs tuned
per shape (cached on disk) and the reduce epilogue finalised by quack. CUDA sm90+ with quack-kernels (the `fa4`
extra) only; models.feed_forward_deferring_out_bias chooses it where quack's MLP runs.
"""

from __future__ import annotations

import torch

from .models import linear_compute_dtype

_GELU = "gelu_tanh_approx"


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


@torch.library.custom_op("sd3cluster::gelu_mlp", mutates_args=(), device_types="cuda")
def gelu_mlp_op(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, preact): out = gelu_tanh(x @ w1.T + b1) @ w2.T (no second bias), preact = x @ w1.T + b1 as rows,
    kept for the backward. x (..., in), w1 (hidden, in), w2 (out, hidden), all one half-precision dtype."""
    from quack.gemm_interface import gemm, gemm_act

    preact, postact = gemm_act(_rows(x), w1.T, bias=b1, activation=_GELU, store_preact=True)
    return gemm(postact, w2.T).view(*x.shape[:-1], w2.shape[0]), preact


@gelu_mlp_op.register_fake
def _(x, w1, b1, w2):
    rows = x.numel() // x.shape[-1]
    return x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty((rows, w1.shape[0]))


@torch.library.custom_op("sd3cluster::gelu_mlp_backward", mutates_args=(), device_types="cuda")
def gelu_mlp_backward_op(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         preact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw1, db1, dw2); db1 fp32, summed in the epilogue of the GEMM that writes the GELU's gradient."""
    from quack.epilogue.library import dgelu_dbias_mod
    from quack.gemm_interface import gemm

    dout_rows = _rows(dout).contiguous()
    result = dgelu_dbias_mod(dout_rows, w2, preact, tuned=True, dynamic_scheduler=True)
    dpreact, postact = result["D"], result["postact"]
    # as quack's own linear backward calls them (its tuned configurations are keyed by these arguments too)
    dw2 = gemm(dout_rows.T, postact, dynamic_scheduler=True)
    dx = gemm(dpreact, w1, dynamic_scheduler=True).view(x.shape)
    dw1 = gemm(dpreact.T, _rows(x), dynamic_scheduler=True)
    return dx, dw1, result["dbias"].reshape(w1.shape[0]).float(), dw2


@gelu_mlp_backward_op.register_fake
def _(dout, x, w1, w2, preact):
    return (x.new_empty(x.shape), w1.new_empty(w1.shape), w1.new_empty((w1.shape[0],), dtype=torch.float32),
            w2.new_empty(w2.shape))


def _setup(ctx, inputs, output) -> None:
    x, w1, b1, w2 = inputs
    _, preact = output
    ctx.save_for_backward(x, w1, w2, preact)
    ctx.bias_dtype = b1.dtype if b1 is not None else None
    ctx.mark_non_differentiable(preact)


def _backward(ctx, dout: torch.Tensor, _dpreact: torch.Tensor | None):
    x, w1, w2, preact = ctx.saved_tensors
    dx, dw1, db1, dw2 = gelu_mlp_backward_op(dout, x, w1, w2, preact)
    return dx, dw1, db1.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None, dw2


gelu_mlp_op.register_autograd(_backward, setup_context=_setup)


def gelu_mlp_without_out_bias(x: torch.Tensor, proj: torch.nn.Linear, out: torch.nn.Linear) -> torch.Tensor:
    """out(gelu_tanh(proj(x))) less out's bias, in half precision (autocast's dtype where it is on) like nn.Linear."""
    dtype = linear_compute_dtype(x)
    b1 = proj.bias.to(dtype) if proj.bias is not None else None
    with torch.autocast("cuda", enabled=False):
        return gelu_mlp_op(x.to(dtype).contiguous(), proj.weight.to(dtype), b1, out.weight.to(dtype))[0]
