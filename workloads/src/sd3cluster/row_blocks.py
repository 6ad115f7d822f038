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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


@torch.library.custom_op("sd3cluster::joined_linear", mutates_args=())
def joined_linear(x1: torch.Tensor, x2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                  b2: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x1, w1, b1) and F.linear(x2, w2, b2) as the first and last rows of one tensor."""
    rows = x1.shape[0]
    out = x1.new_empty((rows + x2.shape[0], *x1.shape[1:-1], w1.shape[0]))
    for x, w, b, block in ((x1, w1, b1, out[:rows]), (x2, w2, b2, out[rows:])):
        if b is None:
            torch.mm(_flat(x), w.t(), out=_flat(block))
        else:
            torch.addmm(b, _flat(x), w.t(), out=_flat(block))
    return out


@joined_linear.register_fake
def _(x1, x2, w1, b1, w2, b2):
    return x1.new_empty((x1.shape[0] + x2.shape[0], *x1.shape[1:-1], w1.shape[0]))


def _linear_grads(dy: torch.Tensor, x: torch.Tensor, has_bias: bool):
    """(dw, db) of F.linear(x, w, b) for output gradient dy."""
    dw = _flat(dy).t().mm(_flat(x))
    return dw, _flat(dy).sum(0) if has_bias else None


def _joined_setup(ctx, inputs, output) -> None:
    x1, x2, w1, b1, w2, b2 = inputs
    ctx.save_for_backward(x1, x2, w1, w2)
    ctx.rows, ctx.bias = x1.shape[0], (b1 is not None, b2 is not None)


def _joined_backward(ctx, dy: torch.Tensor):
    x1, x2, w1, w2 = ctx.saved_tensors
    dy1, dy2 = dy[:ctx.rows], dy[ctx.rows:]  # contiguous row blocks
    dw1, db1 = _linear_grads(dy1, x1, ctx.bias[0])
    dw2, db2 = _linear_grads(dy2, x2, ctx.bias[1])
    return F.linear(dy1, w1.t()), F.linear(dy2, w2.t()), dw1, db1, dw2, db2


joined_linear.register_autograd(_joined_backward, setup_context=_joined_setup)


@torch.library.custom_op("sd3cluster::split_linear", mutates_args=())
def split_linear(x: torch.Tensor, rows: int, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                 b2: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """F.linear of x's first `rows` rows with (w1, b1) and of the others with (w2, b2)."""
    return F.linear(x[:rows], w1, b1), F.linear(x[rows:], w2, b2)


@split_linear.register_fake
def _(x, rows, w1, b1, w2, b2):
    return (x.new_empty((rows, *x.shape[1:-1], w1.shape[0])),
            x.new_empty((x.shape[0] - rows, *x.shape[1:-1], w2.shape[0])))


def _split_setup(ctx, inputs, output) -> None:
    x, rows, w1, b1, w2, b2 = inputs
    ctx.save_for_backward(x, w1, w2)
    ctx.rows, ctx.bias = rows, (b1 is not None, b2 is not None)


def _split_backward(ctx, dy1: torch.Tensor, dy2: torch.Tensor):
    x, w1, w2 = ctx.saved_tensors
    dy1, dy2 = dy1.contiguous(), dy2.contiguous()
    dw1, db1 = _linear_grads(dy1, x[:ctx.rows], ctx.bias[0])
    dw2, db2 = _linear_grads(dy2, x[ctx.rows:], ctx.bias[1])
    # the input's gradient, both row blocks written in place: dx = dy @ w is F.linear(dy, w.t())
    return joined_linear(dy1, dy2, w1.t(), None, w2.t(), None), None, dw1, db1, dw2, db2


split_linear.register_autograd(_split_backward, setup_context=_split_setup)
