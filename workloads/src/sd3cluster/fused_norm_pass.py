"""An Inductor graph pass for the fused norms' blocks: the first norm's backward adds the residual's gradient.

A joint block's input x feeds two ops: the first adaLN norm, and the gated residual before the second norm
(fused_norm.gated_adaln, whose backward passes the residual's gradient on as its dx). Autograd sums the two
gradients of x, so the compiled backward graph ends each stream with `add(adaln_backward(...)[0], other)`: a kernel
that reads both stream-sized gradients and writes their sum (1.5 ms a step of SD3-medium at 1024^2 on an H200,
benchmarks/sd3_training.md run 16). The norm's backward kernel can add a gradient as it writes its own (its `dh`
input), so this pass hands it `other` and drops the add: the stream is read once less and written once less.

It runs after Inductor's own post-grad passes (config.post_grad_custom_post_pass) on every graph Inductor compiles
and changes nothing but that pattern. `install()` sets it where no other custom pass is set.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass


class NormBackwardTakesResidualGradient(CustomGraphPass):
    """add(adaln_backward(dy, x, ...)[0], other) -> adaln_backward(dy, x, ..., dh=other)[0], where `other` is
    computed before the norm's backward and has its gradient's shape and dtype. `rewrites` counts them."""

    def __init__(self) -> None:
        self.rewrites = 0

    def __call__(self, graph: fx.Graph) -> None:
        backward = torch.ops.sd3cluster.adaln_backward.default
        order = {node: i for i, node in enumerate(graph.nodes)}
        for node in list(graph.find_nodes(op="call_function", target=backward)):
            found = self._the_add(node, order)
            if found is None:
                continue
            add, dx, other = found
            node.kwargs = {**node.kwargs, "dh": other}
            add.replace_all_uses_with(dx)
            graph.erase_node(add)
            self.rewrites += 1

    @staticmethod
    def _the_add(node: fx.Node, order: dict[fx.Node, int]) -> tuple[fx.Node, fx.Node, fx.Node] | None:
        """(add, dx, other): the add that is the only use of the norm's dx, and its other operand; None when the
        pattern does not hold exactly."""
        if node.kwargs.get("dh") is not None or len(node.args) > 6:
            return None
        firsts = [use for use in node.users if use.target is operator.getitem and use.args[1] == 0]
        if len(firsts) != 1 or len(firsts[0].users) != 1:
            return None
        dx = firsts[0]
        add = next(iter(dx.users))
        if add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2:
            return None
        other = add.args[1] if add.args[0] is dx else add.args[0]
        if other is dx or not isinstance(other, fx.Node) or order.get(other, len(order)) > order[node]:
            return None
        mine, theirs = dx.meta.get("val"), other.meta.get("val")
        if not isinstance(theirs, torch.Tensor) or not isinstance(mine, torch.Tensor) or theirs.shape != mine.shape \
                or theirs.dtype != mine.dtype or theirs.device != mine.device:
            return None
        return add, dx, other

    def uuid(self) -> str:
        return "sd3cluster.fused_norm_pass.NormBackwardTakesResidualGradient/1"


_PASS = NormBackwardTakesResidualGradient()


def install() -> NormBackwardTakesResidualGradient | None:
    """Set the pass as Inductor's post-grad custom pass, unless another one is set (then nothing changes and the
    adds stay). Returns the pass in place, or None."""
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    if current is None:
        config.post_grad_custom_post_pass = _PASS
        return _PASS
    return current if current is _PASS else None
