"""joined_linear and split_linear (sd3cluster.row_blocks) against F.linear and torch.cat, values and gradients."""

import torch
import torch.nn.functional as F
from sd3cluster.row_blocks import joined_linear, split_linear


def _leaves(*shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes]


def test_joined_linear_is_the_cat_of_two_linears_with_its_gradients():
    x1, x2, w1, b1, w2, b2 = _leaves((5, 2, 6), (3, 2, 6), (4, 6), (4,), (4, 6), (4,))
    expected = torch.cat([F.linear(x1, w1, b1), F.linear(x2, w2, b2)])
    got = joined_linear(x1, x2, w1, b1, w2, b2)
    torch.testing.assert_close(got, expected)
    assert torch.autograd.gradcheck(joined_linear, (x1, x2, w1, b1, w2, b2))
    assert torch.autograd.gradcheck(lambda a, b, c, d: joined_linear(a, b, c, None, d, None), (x1, x2, w1, w2))


def test_split_linear_is_two_linears_over_row_blocks_with_its_gradients():
    x, w1, b1, w2, b2 = _leaves((7, 2, 6), (4, 6), (4,), (3, 6), (3,), seed=1)
    y1, y2 = split_linear(x, 5, w1, b1, w2, b2)
    torch.testing.assert_close(y1, F.linear(x[:5], w1, b1))
    torch.testing.assert_close(y2, F.linear(x[5:], w2, b2))
    assert torch.autograd.gradcheck(lambda *a: split_linear(a[0], 5, *a[1:]), (x, w1, b1, w2, b2))


def test_both_compile_into_one_graph_with_the_same_result():
    x1, x2, w1, b1, w2, b2 = (t.detach().float() for t in _leaves((5, 2, 6), (3, 2, 6), (4, 6), (4,), (4, 6), (4,)))
    w3, w4 = torch.randn(6, 4), torch.randn(6, 4)

    def block(x1, x2):
        joined = joined_linear(x1, x2, w1, b1, w2, b2)
        return split_linear(joined, 5, w3, None, w4, None)

    explained = torch._dynamo.explain(block)(x1, x2)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    for got, expected in zip(torch.compile(block)(x1, x2), block(x1, x2), strict=True):
        torch.testing.assert_close(got, expected)
