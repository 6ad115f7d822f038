"""Two linear layers over two row blocks of one tensor, with no copy joining or splitting the rows.

In the sequence-first joint blocks (model.layout=sequence) the image's and the context's q/k/v projections write
two row blocks of one packed tensor, and the two output projections read two row blocks of the attention's output.
Written as F.linear and torch.cat, Inductor computes each GEMM into a buffer of its own and copies both into the
joined one (the forward's q/k/v, and the backward's gradient of the attention output). Here each GEMM writes its
rows of the joined tensor directly (cuBLAS into a contiguous row slice), inside custom ops that torch.compile keeps
as they are.

`joined_linear(x1, x2, ...)` = torch.cat([F.linear(x1, w1, b1), F.linear(x2, w2, b2)]);
`split_linear(x, rows, ...)` = (F.linear(x[:rows], w1, b1), F.linear(x[rows:], w2, b2)), whose backward joins the
input's gradient with joined_linear. Rows are the first dimension; inputs must be contiguous.

With `quack` (model.projections), a row block of at least QUACK_MIN_ROWS rows runs its GEMMs on quack's instead of
cuBLAS: on an H100 at SD3-medium's 1024^2 batch 8 image stream (32,768 rows) quack's were 5.5 to 8% faster at
sustained load, but 1.1 to 4.6 times slower at the context stream's 1,232 rows, and slower for a weight gradient
whose output has fewer tiles than the card has SMs, which cuBLAS splits over the rows (benchmarks/sd3_training.md
run 19, benchmarks/projection_gemms.py). Half-precision CUDA tensors only (the caller's choice ensures it).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Between the measured points: the image stream's 32,768 rows (quack faster), the context's 1,232 (slower); 512^2
# batch 32's context has 4,928.
QUACK_MIN_ROWS = 8192
# the output tile the weight-gradient rule counts with (128 x 192): an output with fewer such tiles than the card has
# SMs leaves SMs idle unless its sum is split
_WGRAD_TILE = (128, 192)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def quack_takes(rows: int, quack: bool) -> bool:
    """Whether a GEMM over `rows` rows of a row block runs on quack."""
    return quack and rows >= QUACK_MIN_ROWS


def weight_grad_fills_card(out_shape: tuple[int, int], sms: int) -> bool:
    """Whether a weight gradient dy.T @ x with output `out_shape` has a quack tile for every SM. Where it has not,
    cuBLAS splits the sum over the rows (split-K) and stays: quack's tuned split was slower (run 19: 0.263 against
    0.229 ms for the output projection's 1536 x 1536 at 32,768 rows)."""
    return -(-out_shape[0] // _WGRAD_TILE[0]) * -(-out_shape[1] // _WGRAD_TILE[1]) >= sms


@torch.library.custom_op("sd3cluster::quack_matmul", mutates_args=(), device_types="cuda")
def quack_matmul(a: torch.Tensor, b: torch.Tensor, a_transposed: bool) -> torch.Tensor:
    """a @ b (a.T @ b with `a_transposed`) on quack, as an op torch.compile keeps opaque: the backward formulas
    below are traced with fake tensors, which quack's launcher cannot take."""
    from quack.gemm_interface import gemm

    return gemm(a.T if a_transposed else a, b, dynamic_scheduler=True)  # as quack's own linear layer calls it


@quack_matmul.register_fake
def _(a, b, a_transposed):
    return a.new_empty((a.shape[1] if a_transposed else a.shape[0], b.shape[1]))


def _input_grad(dy: torch.Tensor, w: torch.Tensor, quack: bool) -> torch.Tensor:
    """dx = dy @ w of F.linear(x, w) for output gradient dy."""
    if quack_takes(_flat(dy).shape[0], quack):
        return quack_matmul(_flat(dy), w, False).view(*dy.shape[:-1], w.shape[1])
    return F.linear(dy, w.t())


def _linear_into(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor, quack: bool) -> None:
    """out = x @ w.T (+ b), all 2-D, out contiguous."""
    if quack_takes(x.shape[0], quack):
        from quack.gemm_interface import gemm

        gemm(x, w.T, out=out, bias=b, dynamic_scheduler=True)  # as quack's own linear layer calls it
    elif b is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(b, x, w.t(), out=out)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, quack: bool) -> torch.Tensor:
    """F.linear(x, w, b) over x's last dimension."""
    out = x.new_empty((*x.shape[:-1], w.shape[0]))
    _linear_into(_flat(x), w, b, _flat(out), quack)
    return out


@torch.library.custom_op("sd3cluster::joined_linear", mutates_args=())
def joined_linear(x1: torch.Tensor, x2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                  b2: torch.Tensor | None, quack: bool = False) -> torch.Tensor:
    """F.linear(x1, w1, b1) and F.linear(x2, w2, b2) as the first and last rows of one tensor."""
    rows = x1.shape[0]
    out = x1.new_empty((rows + x2.shape[0], *x1.shape[1:-1], w1.shape[0]))
    for x, w, b, block in ((x1, w1, b1, out[:rows]), (x2, w2, b2, out[rows:])):
        _linear_into(_flat(x), w, b, _flat(block), quack)
    return out


@joined_linear.register_fake
def _(x1, x2, w1, b1, w2, b2, quack=False):
    return x1.new_empty((x1.shape[0] + x2.shape[0], *x1.shape[1:-1], w1.shape[0]))


def _linear_grads(dy: torch.Tensor, x: torch.Tensor, has_bias: bool, quack: bool):
    """(dw, db) of F.linear(x, w, b) for output gradient dy."""
    dy, x = _flat(dy), _flat(x)
    if quack_takes(dy.shape[0], quack) and weight_grad_fills_card((dy.shape[1], x.shape[1]),
                                                                  _sm_count(dy.device.index or 0)):
        dw = quack_matmul(dy, x, True)
    else:
        dw = dy.t().mm(x)
    return dw, dy.sum(0) if has_bias else None


def _joined_setup(ctx, inputs, output) -> None:
    x1, x2, w1, b1, w2, b2, quack = inputs
    ctx.save_for_backward(x1, x2, w1, w2)
    ctx.rows, ctx.bias, ctx.quack = x1.shape[0], (b1 is not None, b2 is not None), quack


def _joined_backward(ctx, dy: torch.Tensor):
    x1, x2, w1, w2 = ctx.saved_tensors
    dy1, dy2 = dy[:ctx.rows], dy[ctx.rows:]  # contiguous row blocks
    dw1, db1 = _linear_grads(dy1, x1, ctx.bias[0], ctx.quack)
    dw2, db2 = _linear_grads(dy2, x2, ctx.bias[1], ctx.quack)
    return _input_grad(dy1, w1, ctx.quack), _input_grad(dy2, w2, ctx.quack), dw1, db1, dw2, db2, None


joined_linear.register_autograd(_joined_backward, setup_context=_joined_setup)


@torch.library.custom_op("sd3cluster::split_linear", mutates_args=())
def split_linear(x: torch.Tensor, rows: int, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                 b2: torch.Tensor | None, quack: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """F.linear of x's first `rows` rows with (w1, b1) and of the others with (w2, b2)."""
    return _linear(x[:rows], w1, b1, quack), _linear(x[rows:], w2, b2, quack)


@split_linear.register_fake
def _(x, rows, w1, b1, w2, b2, quack=False):
    return (x.new_empty((rows, *x.shape[1:-1], w1.shape[0])),
            x.new_empty((x.shape[0] - rows, *x.shape[1:-1], w2.shape[0])))


def _split_setup(ctx, inputs, output) -> None:
    x, rows, w1, b1, w2, b2, quack = inputs
    ctx.save_for_backward(x, w1, w2)
    ctx.rows, ctx.bias, ctx.quack = rows, (b1 is not None, b2 is not None), quack


def _split_backward(ctx, dy1: torch.Tensor, dy2: torch.Tensor):
    x, w1, w2 = ctx.saved_tensors
    dy1, dy2 = dy1.contiguous(), dy2.contiguous()
    dw1, db1 = _linear_grads(dy1, x[:ctx.rows], ctx.bias[0], ctx.quack)
    dw2, db2 = _linear_grads(dy2, x[ctx.rows:], ctx.bias[1], ctx.quack)
    # the input's gradient, both row blocks written in place: dx = dy @ w is F.linear(dy, w.t())
    return (joined_linear(dy1, dy2, w1.t(), None, w2.t(), None, ctx.quack), None, dw1, db1, dw2, db2, None)


split_linear.register_autograd(_split_backward, setup_context=_split_setup)
