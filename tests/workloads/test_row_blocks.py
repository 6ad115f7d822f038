"""joined_linear and split_linear (sd3cluster.row_blocks) against F.linear and torch.cat, values and gradients, and
their GEMMs on quack (model.projections) against cuBLAS's where an sm90 GPU and quack-kernels are present (the GPU
machine: benchmarks/sd3_training.md has the command; elsewhere that test says skip)."""

import pytest
import torch
import torch.nn.functional as F
from sd3_helpers import hopper_skip_reason
from sd3cluster.errors import UserError
from sd3cluster.models import quack_mlp_import_problem, resolve_projections
from sd3cluster.row_blocks import QUACK_MIN_ROWS, joined_linear, quack_takes, split_linear, weight_grad_fills_card


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


def test_quack_takes_the_image_streams_rows_and_leaves_the_contexts_to_cublas():
    # SD3-medium at 1024^2 batch 8: 32,768 image rows, 1,232 context rows; 512^2 batch 32: 4,928 context rows
    assert quack_takes(32768, quack=True)
    assert not quack_takes(1232, quack=True) and not quack_takes(4928, quack=True)
    assert not quack_takes(32768, quack=False)


def test_a_weight_gradient_goes_to_quack_only_where_its_output_fills_the_card():
    # an H100's or H200's 132 SMs: q/k/v's 4608 x 1536 gradient has 36 x 8 tiles, the output projection's 12 x 8
    assert weight_grad_fills_card((4608, 1536), sms=132)
    assert not weight_grad_fills_card((1536, 1536), sms=132)
    assert weight_grad_fills_card((1536, 1536), sms=96)


def test_quack_asked_for_small_row_blocks_computes_as_torch():
    """Below QUACK_MIN_ROWS every GEMM stays on torch's: the same values and gradients on a CPU (no quack here)."""
    x1, x2, w1, b1, w2, b2 = _leaves((5, 2, 6), (3, 2, 6), (4, 6), (4,), (4, 6), (4,))
    assert 10 < QUACK_MIN_ROWS
    torch.testing.assert_close(joined_linear(x1, x2, w1, b1, w2, b2, True), joined_linear(x1, x2, w1, b1, w2, b2))
    assert torch.autograd.gradcheck(lambda *a: joined_linear(*a, True), (x1, x2, w1, b1, w2, b2))
    x, w3, w4 = _leaves((7, 2, 6), (4, 6), (3, 6), seed=2)
    assert torch.autograd.gradcheck(lambda a, b, c: split_linear(a, 5, b, None, c, None, True), (x, w3, w4))


def test_projections_resolve_to_torch_off_hopper_and_quack_asked_for_stops_with_the_fix():
    cpu = torch.device("cpu")
    auto = resolve_projections("auto", cpu, half=True, layout="sequence")
    assert auto == ("torch", "torch (auto: not a CUDA device)")
    assert resolve_projections("torch", cpu, half=True, layout="sequence")[0] == "torch"
    with pytest.raises(UserError, match=r"model.projections=quack cannot run here \(not a CUDA device\); set "
                                        r"model.projections=auto or torch"):
        resolve_projections("quack", cpu, half=True, layout="sequence")
    with pytest.raises(UserError, match="choose one of auto, torch, quack"):
        resolve_projections("cublas", cpu, half=True, layout="sequence")


def test_projections_say_why_not_where_lora_or_float8_replace_the_linears(monkeypatch):
    """On a (stood-in) Hopper GPU the reasons past the device's: the layout, then what replaced the linears."""
    from sd3cluster import models

    monkeypatch.setattr(models.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(models, "quack_mlp_import_problem", lambda: None)
    gpu = torch.device("cuda", 0)
    assert resolve_projections("auto", gpu, half=True, layout="sequence")[0] == "quack"
    assert resolve_projections("auto", gpu, half=True, layout="batch")[1].startswith(
        "torch (auto: model.layout resolved to batch")
    assert resolve_projections("auto", gpu, half=True, layout="sequence", adapted_by="LoRA adapters") == (
        "torch", "torch (auto: LoRA adapters on the linears)")
    with pytest.raises(UserError, match=r"model.projections=quack cannot run here \(float8 \(rowwise\) on the "
                                        r"linears\); set model.projections=auto or torch"):
        resolve_projections("quack", gpu, half=True, layout="sequence", adapted_by="float8 (rowwise)")


def test_the_quack_path_traces_with_fake_tensors_its_gemms_opaque(monkeypatch):
    """torch.compile traces the ops' backward formulas with fake tensors, which quack's launcher cannot take (the
    step failed so on the GPU once): every quack GEMM of the backward must be the opaque quack_matmul op. Traced on
    the CPU, with a card of one SM so that every weight gradient of the large block qualifies too."""
    from sd3cluster import row_blocks
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    monkeypatch.setattr(row_blocks, "_sm_count", lambda index: 1)
    c, rows = 64, QUACK_MIN_ROWS

    def step(x1, x2, wq1, bq1, wq2, bq2, wo1, wo2):
        qkv = joined_linear(x1, x2, wq1, bq1, wq2, bq2, True)
        y1, y2 = split_linear(qkv[:, :c], rows, wo1, None, wo2, None, True)
        return torch.autograd.grad(y1.float().sum() + y2.float().sum(), (x1, x2, wq1, bq1, wq2, bq2, wo1, wo2))

    with FakeTensorMode():
        shapes = ((rows, c), (100, c), (3 * c, c), (3 * c,), (3 * c, c), (3 * c,), (c, c), (c, c))
        args = [torch.empty(*s, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    graph = make_fx(step, tracing_mode="fake")(*args).graph
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function" and "sd3cluster" in str(n.target)]
    # the image rows' input gradient of q/k/v and both of its weight gradients (q/k/v's, the output projection's)
    assert ops.count("sd3cluster.quack_matmul.default") == 3, ops


def _quack_ready() -> str | None:
    return hopper_skip_reason("quack's GEMMs", quack_mlp_import_problem)


@pytest.mark.parametrize("compiled", [False, True])
def test_quack_row_blocks_equal_cublas_in_values_and_gradients(compiled):
    """On an sm90 GPU: the image stream's rows on quack, the context's on cuBLAS, against cuBLAS for both, eager
    and compiled (as a training step runs them)."""
    why = _quack_ready()
    if why:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(3)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16().requires_grad_()

    c, rows, ctx_rows = 1536, QUACK_MIN_ROWS * 4, 1232
    x1, x2 = leaf(rows, c), leaf(ctx_rows, c)
    wq1, wq2, bq1, bq2 = leaf(3 * c, c, scale=0.02), leaf(3 * c, c, scale=0.02), leaf(3 * c), leaf(3 * c)
    wo1, wo2 = leaf(c, c, scale=0.02), leaf(c, c, scale=0.02)
    leaves = (x1, x2, wq1, wq2, bq1, bq2, wo1, wo2)

    def step(quack):
        qkv = joined_linear(x1, x2, wq1, bq1, wq2, bq2, quack)
        y1, y2 = split_linear(qkv[:, :c], rows, wo1, None, wo2, None, quack)
        grads = torch.autograd.grad((y1.float().square().mean() + y2.float().square().mean()), leaves)
        return (qkv, y1, y2, *grads)

    results = {quack: (torch.compile(step) if compiled else step)(quack) for quack in (False, True)}
    for name, got, expected in zip(("qkv", "y1", "y2", "dx1", "dx2", "dwq1", "dwq2", "dbq1", "dbq2", "dwo1", "dwo2"),
                                   results[True], results[False], strict=True):
        err = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e} against cuBLAS"
