"""The attention backends: one layout, one choice; FlashAttention-4 against cuDNN inside the model on a GPU.

The GPU tests run where CUDA, an sm90+ GPU and flash-attn-4 are present (the GPU machine: see
benchmarks/sd3_training.md for the command) and say skip elsewhere.
"""

import pytest
import torch
from sd3_helpers import hopper_skip_reason
from sd3cluster.attention import attention, fa4_import_problem, resolve_backend
from sd3cluster.errors import UserError
from sd3cluster.models import fuse_qkv


def test_sdpa_backend_keeps_the_projection_layout():
    """(batch, tokens, heads, head_dim) in and out, equal to softmax(q k^T / sqrt(d)) v computed by hand."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 3, 8, generator=gen) for _ in range(3))
    out = attention(q, k, v, "sdpa")
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    assert out.shape == (2, 7, 3, 8)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_half_precision_kernels_leave_fp32_inputs_to_sdpa():
    """A GPU kernel name on fp32 inputs (train.precision=fp32) computes with PyTorch's dispatch, not an error."""
    q = torch.randn(1, 5, 2, 8)
    torch.testing.assert_close(attention(q, q, q, "cudnn"), attention(q, q, q, "sdpa"), rtol=0, atol=0)


def test_gpu_backends_stop_on_a_cpu_with_the_fix_named():
    assert resolve_backend("auto", torch.device("cpu"))[0] == "sdpa"
    assert resolve_backend("sdpa", torch.device("cpu"))[0] == "sdpa"
    for name in ("fa4", "cudnn", "flash"):
        with pytest.raises(UserError, match=f"model.attention={name} runs on CUDA devices only.*use auto or sdpa"):
            resolve_backend(name, torch.device("cpu"))
    with pytest.raises(UserError, match="choose one of auto, fa4, cudnn, flash, sdpa"):
        resolve_backend("fa3", torch.device("cpu"))


def test_fa4_op_is_registered_with_shapes_for_tracing():
    """The custom op and its fake (what torch.compile traces with) exist on every machine, GPU or not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 10, 4, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.sd3cluster.fa4_attention(q, q, q)
    assert out.shape == (2, 10, 4, 64) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 10) and lse.dtype == torch.float32


def _fa4_ready() -> str | None:
    return hopper_skip_reason("FlashAttention-4", fa4_import_problem)


def _small_sd3(device: torch.device) -> torch.nn.Module:
    """Two joint blocks with SD3's head_dim 64 (the tiny preset's 8 is below what FA4 takes)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=64,
                                 num_attention_heads=4, joint_attention_dim=128, caption_projection_dim=256,
                                 pooled_projection_dim=64, out_channels=16, pos_embed_max_size=32).to(device)


def _inputs(device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(1)
    return dict(hidden_states=torch.randn(2, 16, 32, 32, device=device, generator=gen, dtype=torch.bfloat16),
                encoder_hidden_states=torch.randn(2, 20, 128, device=device, generator=gen, dtype=torch.bfloat16),
                pooled_projections=torch.randn(2, 64, device=device, generator=gen, dtype=torch.bfloat16),
                timestep=torch.tensor([100.0, 700.0], device=device, dtype=torch.bfloat16))


def test_fa4_equals_cudnn_in_the_model_output_and_gradients():
    why = _fa4_ready()
    if why:
        pytest.skip(why)
    device = torch.device("cuda")
    results = {}
    for backend in ("cudnn", "fa4"):
        model = fuse_qkv(_small_sd3(device).to(torch.bfloat16), attention_backend=backend)
        out = model(**_inputs(device), return_dict=False)[0]
        out.float().square().mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if "attn" in n and p.grad is not None}
        results[backend] = (out.float(), grads)
    (out_c, grads_c), (out_f, grads_f) = results["cudnn"], results["fa4"]
    # Both are bf16 kernels with fp32 accumulation: they differ by bf16 rounding, not by an error.
    assert (out_f - out_c).norm() / out_c.norm() < 2e-2
    assert grads_c.keys() == grads_f.keys() and len(grads_c) >= 8
    for name, grad in grads_c.items():
        assert (grads_f[name] - grad).norm() / grad.norm().clamp_min(1e-12) < 5e-2, name


def test_fa4_compiles_into_one_graph_per_block():
    why = _fa4_ready()
    if why:
        pytest.skip(why)
    device = torch.device("cuda")
    model = fuse_qkv(_small_sd3(device).to(torch.bfloat16), attention_backend="fa4")
    block = model.transformer_blocks[0]
    hidden = torch.randn(2, 256, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    context = torch.randn(2, 20, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    temb = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    explained = torch._dynamo.explain(block)(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_packed_fa4_op_is_registered_with_shapes_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.empty(10, 2, 3, 4, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.sd3cluster.fa4_attention_packed(qkv)
        dqkv = torch.ops.sd3cluster.fa4_attention_packed_backward(out, qkv, out, lse)
    assert out.shape == (10, 2, 4, 64) and lse.shape == (2, 4, 10) and dqkv.shape == qkv.shape


def test_packed_attention_off_fa4_equals_attention_over_the_views():
    from sd3cluster.attention import packed_attention

    qkv = torch.randn(9, 2, 3, 2, 8)
    q, k, v = (qkv[:, :, i].transpose(0, 1) for i in range(3))
    torch.testing.assert_close(packed_attention(qkv, "fa4"), attention(q, k, v, "sdpa").transpose(0, 1))


def test_packed_fa4_equals_fa4_on_separate_tensors_with_its_gradient():
    """The packed op reads q, k, v and writes out and dq, dk, dv through strided views of the packed layout; the
    result is FA4's on contiguous copies (the same kernels on the same values; dq adds its parts with atomics, so
    its last bits may differ between two runs)."""
    why = _fa4_ready()
    if why:
        pytest.skip(why)
    gen = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.randn(4250, 2, 3, 24, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(4250, 2, 24, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.ops.sd3cluster.fa4_attention_packed(qkv)[0]
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    separate = [qkv[:, :, i].transpose(0, 1).contiguous().detach().requires_grad_() for i in range(3)]
    ref = torch.ops.sd3cluster.fa4_attention(*separate)[0]
    grads = torch.autograd.grad(ref, separate, dout.transpose(0, 1))
    assert torch.equal(out, ref.transpose(0, 1))
    for i, grad in enumerate(grads):
        got = dqkv[:, :, i].float()
        expected = grad.transpose(0, 1).float()
        assert ((got - expected).norm() / expected.norm()).item() < 1e-3, "qkv"[i]
