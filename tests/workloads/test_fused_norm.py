"""The fused adaLN kernels (model.norm=triton) against PyTorch's LayerNorm and diffusers' joint block.

The kernel tests run the Triton kernels on the CPU under Triton's interpreter where Triton is installed
(requirements.txt has it; conftest.py turns the interpreter on without a GPU), and say skip elsewhere; the GPU tests
run the compiled kernels where CUDA is present (the GPU machine: see benchmarks/sd3_training.md for the command).
"""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from sd3cluster import fused_norm
from sd3cluster.config import Config
from sd3cluster.errors import UserError
from sd3cluster.fused_norm import fuse_norms, resolve_norm
from sd3cluster.models import build_transformer

interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs Triton's interpreter (Triton installed, no GPU)")


def _reference(x, branch, gate, shift, scale, eps, bias=None):
    h = x + gate[:, None] * (branch + (bias if bias is not None else 0)) if branch is not None else x
    y = F.layer_norm(h, (x.shape[-1],), eps=eps) * (1 + scale[:, None]) + shift[:, None]
    return h, y


def _inputs(gated, dtype=torch.float64, batch=2, tokens=37, channels=48):
    """Tokens not a multiple of 8 (the backward's rows per program), channels not a power of two: masked edges."""
    gen = torch.Generator().manual_seed(3)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()

    x = leaf(batch, tokens, channels) * 3 + 1
    x = x.detach().requires_grad_()
    branch, gate = (leaf(batch, tokens, channels), leaf(batch, channels)) if gated else (None, None)
    return x, branch, gate, leaf(batch, channels), leaf(batch, channels)


@interpreter
@pytest.mark.parametrize("seq_first", [False, True], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("gated, with_bias", [(False, False), (True, False), (True, True)],
                         ids=["adaln", "gated_adaln", "gated_adaln_bias"])
def test_kernels_equal_layer_norm_and_modulation_and_their_gradients(gated, with_bias, seq_first):
    """Also in the sequence-first layout (tokens, batch, channels), where row r belongs to sample r % batch; the
    gated one also with the branch's bias (the attention's output projection's, left to the norm)."""
    x, branch, gate, shift, scale = _inputs(gated)
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(x.shape[-1], generator=gen, dtype=x.dtype).requires_grad_() if with_bias else None
    leaves = [t for t in (x, branch, gate, shift, scale, bias) if t is not None]
    dy, dh = torch.randn(x.shape, generator=gen, dtype=x.dtype), torch.randn(x.shape, generator=gen, dtype=x.dtype)

    h, y = _reference(x, branch, gate, shift, scale, 1e-6, bias)
    expected = torch.autograd.grad((y * dy).sum() + ((h * dh).sum() if gated else 0), leaves)

    def layout(t):  # the kernels' input in the layout under test, its output back in (batch, tokens, channels)
        return t.transpose(0, 1).contiguous() if seq_first and t is not None else t

    if gated:
        h_k, y_k = fused_norm.gated_adaln(layout(x), layout(branch), gate, shift, scale, 1e-6, seq_first, bias)
        h_k, y_k = layout(h_k), layout(y_k)
        torch.testing.assert_close(h_k, h, rtol=0, atol=1e-5)
    else:
        y_k = layout(fused_norm.adaln(layout(x), shift, scale, 1e-6, seq_first))
    assert y_k.dtype == x.dtype
    torch.testing.assert_close(y_k, y, rtol=0, atol=1e-5)  # the kernels compute in fp32
    got = torch.autograd.grad((y_k * dy).sum() + ((h_k * dh).sum() if gated else 0), leaves)
    names = ["x", "branch", "gate", "shift", "scale", "bias"][:len(leaves)] if gated else ["x", "shift", "scale"]
    for name, g, e in zip(names, got, expected, strict=True):
        assert g.dtype == e.dtype, name
        torch.testing.assert_close(g, e, rtol=0, atol=5e-5, msg=lambda m, n=name: f"d{n}: {m}")


@interpreter
@pytest.mark.parametrize("seq_first", [False, True], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_gated_residual_equals_torch_with_its_gradients(with_bias, seq_first):
    """h + gate * (branch + bias), the residual update after the feed-forward, which takes the output projection's
    bias: its value and the gradients of h, branch, gate (a chunk of a wider modulation, read with its row stride)
    and bias, which the backward sums per program as it writes the branch's gradient."""
    x, branch, _, _, _ = _inputs(True)
    gen = torch.Generator().manual_seed(7)
    joined = torch.randn(2, 2 * 48, generator=gen, dtype=x.dtype).requires_grad_()
    bias = torch.randn(48, generator=gen, dtype=x.dtype).requires_grad_() if with_bias else None
    dout = torch.randn(x.shape, generator=gen, dtype=x.dtype)
    gate = joined.chunk(2, dim=1)[1]
    leaves = [t for t in (x, branch, joined, bias) if t is not None]
    expected_out = x + gate[:, None] * (branch + (bias if with_bias else 0))
    expected = torch.autograd.grad((expected_out * dout).sum(), leaves)

    def layout(t):
        return t.transpose(0, 1).contiguous() if seq_first else t

    out = layout(fused_norm.gated_residual(layout(x), layout(branch), gate, bias, seq_first))
    assert out.dtype == x.dtype
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-5)  # computed in fp32
    got = torch.autograd.grad((out * dout).sum(), leaves)
    for name, g, e in zip(["h", "branch", "gate", "bias"], got, expected, strict=False):
        assert g.dtype == e.dtype, name
        torch.testing.assert_close(g, e, rtol=0, atol=5e-5, msg=lambda m, n=name: f"d{n}: {m}")


@interpreter
@pytest.mark.parametrize("seq_first", [False, True], ids=["batch_first", "seq_first"])
def test_backward_ops_fake_shapes_equal_the_kernels_partial_sums(seq_first):
    """The backward ops hand back their per-program partial sums (summed outside, in the compiled backward): the
    shapes a compiled graph plans with (the fake implementations) equal what the kernels write, at tokens where
    the last program's rows run past the end."""
    x, branch, gate, shift, scale = _inputs(True)
    if seq_first:
        x, branch = x.transpose(0, 1).contiguous(), branch.transpose(0, 1).contiguous()
    x, branch, gate, scale = (t.detach() for t in (x, branch, gate, scale))
    bias = torch.randn(x.shape[-1], dtype=x.dtype)
    _, _, mean, rstd = torch.ops.sd3cluster.gated_adaln(x, branch, gate, bias, shift.detach(), scale, 1e-6, x.dtype,
                                                        seq_first)
    dy = torch.randn_like(x)
    ops = [(torch.ops.sd3cluster.adaln_backward, (dy, x, scale, mean, rstd, seq_first)),
           (torch.ops.sd3cluster.gated_adaln_backward, (dy, dy, x, branch, gate, bias, scale, mean, rstd, seq_first)),
           (torch.ops.sd3cluster.gated_residual_backward, (dy, branch, gate, seq_first))]
    for op, args in ops:
        *_, partial = op(*args)
        assert partial.shape[1:] == (2, fused_norm.backward_parts(2, 37), 48), op
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@interpreter
def test_kernels_read_the_modulation_chunks_in_place():
    """Shift, scale and gate as chunks of one (batch, 3 x channels) tensor, as a joint block's modulation hands them
    (read with their row stride, not copied), and one of them copied (strides differ: all copied): the same results
    and gradients as contiguous ones."""
    x, branch, *_ = _inputs(True)
    gen = torch.Generator().manual_seed(6)
    joined = torch.randn(2, 3 * 48, generator=gen, dtype=x.dtype).requires_grad_()
    assert fused_norm._per_sample(*joined.chunk(3, dim=1))[1] == 3 * 48
    results = []
    for arrange in (lambda t: t.chunk(3, dim=1), lambda t: [c.contiguous() for c in t.chunk(3, dim=1)],
                    lambda t: [*t.chunk(3, dim=1)[:2], t.chunk(3, dim=1)[2].contiguous()]):
        gate, shift, scale = arrange(joined)
        h, y = fused_norm.gated_adaln(x, branch, gate, shift, scale, 1e-6)
        y2 = fused_norm.adaln(h, shift, scale, 1e-6)
        results.append((h, y2, *torch.autograd.grad((y * y2).sum() + h.sum(), (x, branch, joined))))
    for other in results[1:]:
        for got, expected in zip(results[0], other, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@interpreter
def test_kernels_catch_a_wrong_statistic():
    """The epsilon reaches the kernel: one off by 1e-2 moves the output past the forward comparison's tolerance
    (1e-5) by far, so that comparison would see a kernel that ignored or misread it."""
    x, _, _, shift, scale = _inputs(False, channels=8)
    x = (x * 1e-3).detach()  # tiny variance, where epsilon matters
    y = _reference(x, None, None, shift, scale, 1e-6)[1]
    assert (fused_norm.adaln(x, shift, scale, 1e-2) - y).abs().max() > 1e-3


def _tiny_inputs() -> dict:
    """A forward's inputs for the tiny preset's transformer (8x8 latents, 7 text tokens), seeded."""
    gen = torch.Generator().manual_seed(5)
    return dict(hidden_states=torch.randn(2, 16, 8, 8, generator=gen),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
                pooled_projections=torch.randn(2, 16, generator=gen), timestep=torch.tensor([10.0, 900.0]))


@interpreter
def test_fused_block_equals_diffusers_in_output_and_every_gradient():
    plain, fused = build_transformer("tiny"), build_transformer("tiny")
    names = list(fused.state_dict())
    # tiny: two joint blocks; the last has no modulated context stream (context_pre_only) and keeps diffusers'
    assert fuse_norms(fused) == 1
    assert list(fused.state_dict()) == names
    inputs = _tiny_inputs()
    outputs = {}
    for name, model in (("plain", plain), ("fused", fused)):
        out = model(**inputs, return_dict=False)[0]
        out.square().mean().backward()
        outputs[name] = (out, {n: p.grad for n, p in model.named_parameters()})
    (out_p, grads_p), (out_f, grads_f) = outputs["plain"], outputs["fused"]
    torch.testing.assert_close(out_f, out_p, rtol=1e-4, atol=1e-5)
    assert grads_p.keys() == grads_f.keys()
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_fused_block_keeps_diffusers_forward_off_cuda(monkeypatch):
    """Without the interpreter a CPU call is diffusers' own forward, to the last bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plain, fused = build_transformer("tiny"), build_transformer("tiny")
    fuse_norms(fused)
    block_p, block_f = plain.transformer_blocks[0], fused.transformer_blocks[0]
    hidden, context, temb = torch.randn(2, 16, 16), torch.randn(2, 7, 16), torch.randn(2, 16)
    for a, b in zip(block_f(hidden, context, temb), block_p(hidden, context, temb), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resolve_norm_names_the_choice_and_the_fix():
    cpu = torch.device("cpu")
    assert resolve_norm("auto", cpu) == ("torch", "torch (auto: not a CUDA device)")
    assert resolve_norm("torch", cpu)[0] == "torch"
    with pytest.raises(UserError, match=r"model\.norm=triton cannot run here \(not a CUDA device\); "
                                        r"set model\.norm=auto or torch"):
        resolve_norm("triton", cpu)
    with pytest.raises(UserError, match="choose one of auto, torch, triton"):
        resolve_norm("apex", cpu)


def test_resolve_layout_takes_sequence_where_fa4_and_the_fused_norms_run_the_blocks():
    from sd3cluster.models import resolve_layout

    assert resolve_layout("auto", True, "fa4", "triton")[0] == "sequence"
    assert resolve_layout("batch", True, "fa4", "triton") == ("batch", "batch (asked for)")
    for args, words in (((False, "fa4", "triton"), "model.fuse_qkv=false"),
                        ((True, "cudnn", "triton"), "the attention runs on cudnn"),
                        ((True, "fa4", "torch"), "model.norm resolved to torch")):
        kind, why = resolve_layout("auto", *args)
        assert kind == "batch" and words in why, why
        with pytest.raises(UserError, match=r"model\.layout=sequence cannot run here .*set model\.layout=auto or "
                                            r"batch"):
            resolve_layout("sequence", *args)
    with pytest.raises(UserError, match=r"model\.layout='rows'; choose one of auto, batch, sequence"):
        resolve_layout("rows", True, "fa4", "triton")


def test_config_rejects_an_unknown_norm():
    with pytest.raises(ValueError, match="norm"):
        Config.model_validate({"model": {"preset": "tiny", "norm": "apex"}})


# -- on the GPU -----------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _joint_blocks(dim: int, heads: int, count: int, device="cpu") -> list:
    """`count` joint blocks of SD3's layout, the last with an unmodulated context (context_pre_only), seeded."""
    from diffusers.models.attention import JointTransformerBlock

    torch.manual_seed(0)
    return [JointTransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=dim // heads,
                                  context_pre_only=i == count - 1).to(device) for i in range(count)]


def _run_blocks(blocks, hidden, context, temb):
    for block in blocks:
        context, hidden = block(hidden, context, temb)
    return hidden, context


def _chained(blocks) -> torch.nn.Module:
    """The blocks as a model's block list, fused and chained as fuse_norms does to a transformer's."""
    holder = torch.nn.Module()
    holder.transformer_blocks = torch.nn.ModuleList(blocks)
    fuse_norms(holder)
    return holder


@interpreter
@pytest.mark.parametrize("chained", [False, True], ids=["one_by_one", "chained"])
def test_sequence_first_blocks_equal_diffusers_in_output_and_every_gradient(chained):
    """With fused q/k/v on the FA4 backend the fused blocks run their streams as (tokens, batch, channels). Fused
    one by one, each takes (batch, tokens, channels) and hands a transposed view; chained (a block list's, as in a
    model), the streams stay (tokens, batch, channels) between them and only the last fused block hands a view,
    which the last block (diffusers' forward) takes as it is. fp32 inputs route the packed attention to sdpa, so
    this runs on the CPU; the GPU test below runs FA4 itself."""
    from sd3cluster.models import fuse_qkv, sequence_first_backend

    plain, fused = _joint_blocks(32, 2, 4), _joint_blocks(32, 2, 4)
    for block in fused:
        fuse_qkv(block, attention_backend="fa4", sequence_first=True)
    if chained:
        _chained(fused)
        assert [block.sequence_first_chain for block in fused[:3]] == [(False, True), (True, True), (True, False)]
    else:
        assert sum(fuse_norms(block) for block in fused) == 3
        assert {block.sequence_first_chain for block in fused[:3]} == {(False, False)}
    assert sequence_first_backend(fused[0].attn) == "fa4" and sequence_first_backend(plain[0].attn) is None
    gen = torch.Generator().manual_seed(7)
    hidden, context = torch.randn(2, 19, 32, generator=gen), torch.randn(2, 5, 32, generator=gen)
    temb = torch.randn(2, 32, generator=gen)
    out_c, out_h = fused[0](hidden, context, temb)
    if chained:  # (tokens, batch, channels), contiguous: the next block's backward gets a contiguous gradient
        assert out_h.shape == (19, 2, 32) and out_h.is_contiguous() and out_c.shape == (5, 2, 32)
    else:  # a view of (tokens, batch, channels)
        assert out_h.shape == (2, 19, 32) and out_h.stride() == (32, 2 * 32, 1)
    results = {}
    for name, blocks in (("plain", plain), ("fused", fused)):
        h, c = hidden.clone().requires_grad_(), context.clone().requires_grad_()
        out_h, out_c = _run_blocks(blocks, h, c, temb)
        (out_h.square().mean() + (out_c.square().mean() if out_c is not None else 0)).backward()
        grads = {}
        for i, block in enumerate(blocks):
            grads.update({f"{i}.{n}": p.grad for n, p in block.named_parameters() if p.grad is not None})
        results[name] = (out_h, h.grad, c.grad, grads)
    (out_p, dh_p, dc_p, grads_p), (out_f, dh_f, dc_f, grads_f) = results["plain"], results["fused"]
    torch.testing.assert_close(out_f, out_p, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dh_f, dh_p, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(dc_f, dc_p, rtol=1e-3, atol=1e-6)
    fused_names = {n.replace("to_qkv", "to_q").replace("to_added_qkv", "add_q_proj") for n in grads_f}
    assert {n for n in grads_p if "to_k" not in n and "to_v" not in n and "add_k" not in n and "add_v" not in n} \
        == fused_names
    for name, grad in grads_f.items():
        if "qkv" in name:  # the fused projection's gradient is the three diffusers ones, stacked
            parts = ("to_q", "to_k", "to_v") if "to_qkv" in name else ("add_q_proj", "add_k_proj", "add_v_proj")
            grad_p = torch.cat([grads_p[name.replace("to_added_qkv" if "added" in name else "to_qkv", part)]
                                for part in parts])
        else:
            grad_p = grads_p[name]
        torch.testing.assert_close(grad, grad_p, rtol=1e-3, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@interpreter
def test_compiled_block_adds_the_residual_gradient_in_the_norm_backward():
    """Compiled (Inductor on the CPU, the kernels under the interpreter), a fused block's backward hands the
    residual's gradient of its input to the first norm's backward (fused_norm_pass) instead of adding the two in a
    kernel of their own: once per stream, and the gradients equal the uncompiled block's."""
    from sd3cluster import fused_norm_pass
    from sd3cluster.models import fuse_qkv

    blocks = _joint_blocks(32, 2, 2)
    for block in blocks:
        fuse_qkv(block, attention_backend="fa4", sequence_first=True)
    holder = _chained(blocks)
    graph_pass = fused_norm_pass.install()
    assert graph_pass is torch._inductor.config.post_grad_custom_post_pass
    gen = torch.Generator().manual_seed(8)
    hidden, context = torch.randn(2, 19, 32, generator=gen), torch.randn(2, 5, 32, generator=gen)
    temb = torch.randn(2, 32, generator=gen)
    first = holder.transformer_blocks[0]
    results = []
    torch._dynamo.reset()
    # compiled afresh: a graph from Inductor's caches (an earlier run's) would not pass through the pass again
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        for run in (first, torch.compile(first)):
            h, c = hidden.clone().requires_grad_(), context.clone().requires_grad_()
            out_c, out_h = run(h, c, temb)
            (out_h.square().mean() + out_c.square().mean()).backward()
            results.append((out_h, h.grad, c.grad, {n: p.grad.clone() for n, p in first.named_parameters()}))
            first.zero_grad(set_to_none=True)
            if run is first:
                before = graph_pass.rewrites
    assert graph_pass.rewrites - before == 2  # the image stream's and the context's
    (out_e, dh_e, dc_e, grads_e), (out_k, dh_k, dc_k, grads_k) = results
    torch.testing.assert_close(out_k, out_e, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dh_k, dh_e, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dc_k, dc_e, rtol=1e-4, atol=1e-6)
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_k[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@interpreter
def test_chained_transformer_equals_diffusers_and_refuses_what_breaks_the_chain():
    """A whole SD3 transformer, its joint blocks chained sequence-first, against diffusers' (output and the input's
    gradient); arguments that would hand a block a stream of the other layout stop with the fix."""
    from diffusers import SD3Transformer2DModel
    from sd3cluster.models import fuse_qkv, preset_config

    config = {**preset_config("tiny"), "num_layers": 4}
    torch.manual_seed(0)
    plain = SD3Transformer2DModel(**config)
    fused = SD3Transformer2DModel(**config)
    fused.load_state_dict(plain.state_dict())
    fuse_qkv(fused, attention_backend="fa4", sequence_first=True)
    assert fuse_norms(fused) == 3
    assert fused.transformer_blocks[1].sequence_first_chain == (True, True)
    inputs = _tiny_inputs()
    outputs = {}
    for name, model in (("plain", plain), ("fused", fused)):
        latents = inputs["hidden_states"].clone().requires_grad_()
        out = model(**{**inputs, "hidden_states": latents}, return_dict=False)[0]
        out.square().mean().backward()
        outputs[name] = (out, latents.grad)
    for got, expected in zip(outputs["fused"], outputs["plain"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)
    with pytest.raises(UserError, match=r"skip_layers cannot be given .*set model\.layout=batch"):
        fused(**inputs, skip_layers=[1])
    with pytest.raises(UserError, match=r"block_controlnet_hidden_states cannot be given"):
        fused(inputs["hidden_states"], inputs["encoder_hidden_states"], inputs["pooled_projections"],
              inputs["timestep"], [torch.zeros(2, 16, 16)])
    plain(**inputs, skip_layers=[1])  # diffusers' own model takes them


@interpreter
def test_chained_blocks_keep_lora_adapters_in_the_sequence_first_layout():
    """With LoRA's linears (not plain nn.Linear) the sequence-first attention calls the projections' own forward:
    the chained model with adapters (made non-zero) equals the batch layout's in output and every adapter's
    gradient, so no adapter is bypassed by the in-place GEMMs."""
    from diffusers import SD3Transformer2DModel
    from sd3cluster.lora import apply_lora
    from sd3cluster.models import fuse_qkv, preset_config

    config = {**preset_config("tiny"), "num_layers": 4}
    results = []
    for sequence_first in (True, False):
        torch.manual_seed(0)
        model = SD3Transformer2DModel(**config)
        fuse_qkv(model, attention_backend="fa4", sequence_first=sequence_first)
        fuse_norms(model)
        names = apply_lora(model, Config().lora, fused=True, seed=0)
        with torch.no_grad():  # B starts at zero; seeded values make every adapter change the output
            gen = torch.Generator().manual_seed(9)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        assert model.transformer_blocks[1].sequence_first_chain == ((True, True) if sequence_first else (False, False))
        out = model(**_tiny_inputs(), return_dict=False)[0]
        params = dict(model.named_parameters())
        grads = torch.autograd.grad(out.square().mean(), [params[n] for n in names])
        results.append((out, dict(zip(names, grads, strict=True))))
    (out_seq, grads_seq), (out_batch, grads_batch) = results
    assert any("to_qkv" in n for n in grads_seq) and any("to_add_out" in n for n in grads_seq)
    torch.testing.assert_close(out_seq, out_batch, rtol=1e-4, atol=1e-5)
    assert grads_seq.keys() == grads_batch.keys()
    for name, grad in grads_batch.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_seq[name], grad, rtol=1e-3, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _sd3_block_pair(device):
    """Two SD3-medium joint blocks with the same weights (fp32, autocast as in training), one of them fused."""
    from diffusers.models.attention import JointTransformerBlock

    blocks = []
    for _ in range(2):
        torch.manual_seed(0)
        blocks.append(JointTransformerBlock(dim=1536, num_attention_heads=24, attention_head_dim=64).to(device))
    assert fuse_norms(blocks[1]) == 1
    return blocks


def _sd3_medium_inputs(device):
    """Image and context streams and the time embedding at SD3-medium's width (1024 image tokens, 154 text)."""
    gen = torch.Generator(device=device).manual_seed(1)
    return (torch.randn(2, 1024, 1536, device=device, generator=gen),
            torch.randn(2, 154, 1536, device=device, generator=gen), torch.randn(2, 1536, device=device, generator=gen))


@needs_cuda
def test_fused_block_equals_diffusers_on_the_gpu_at_sd3_medium_width():
    device = torch.device("cuda")
    plain, fused = _sd3_block_pair(device)
    hidden, context, temb = _sd3_medium_inputs(device)
    results = {}
    for name, block in (("plain", plain), ("fused", fused)):
        h, c = hidden.clone().requires_grad_(), context.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out_c, out_h = block(h, c, temb)
        (out_h.float().square().mean() + out_c.float().square().mean()).backward()
        grads = {n: p.grad.float() for n, p in block.named_parameters()}
        results[name] = (out_h.float(), out_c.float(), h.grad, c.grad, grads)
    plain_r, fused_r = results["plain"], results["fused"]
    for label, a, b in (("image out", *[r[0] for r in (fused_r, plain_r)]),
                        ("context out", *[r[1] for r in (fused_r, plain_r)]),
                        ("d image", *[r[2] for r in (fused_r, plain_r)]),
                        ("d context", *[r[3] for r in (fused_r, plain_r)])):
        assert ((a - b).norm() / b.norm()).item() < 2e-2, label
    for name, grad in plain_r[4].items():
        assert ((fused_r[4][name] - grad).norm() / grad.norm().clamp_min(1e-12)).item() < 5e-2, name


def test_sequence_first_blocks_equal_diffusers_on_the_gpu_with_fa4_and_compile_in_one_graph():
    """SD3-medium-width blocks, the fused ones on FA4 in the sequence-first layout (with quack's feed-forward where
    it imports: its output bias left to the gated residual, its first bias's gradient from a GEMM's epilogue), under
    autocast as in training, eager and compiled (where the first norm's backward adds the residual's gradient):
    outputs, input gradients and the biases' and modulations' gradients against diffusers'."""
    from sd3cluster.attention import fa4_import_problem
    from sd3cluster.models import fuse_mlp, fuse_qkv, quack_mlp_import_problem

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9 or fa4_import_problem():
        pytest.skip("needs an sm90+ GPU with flash-attn-4")
    device = torch.device("cuda")
    plain, fused = _joint_blocks(1536, 24, 3, device), _joint_blocks(1536, 24, 3, device)
    for block in fused:
        fuse_qkv(block, attention_backend="fa4", sequence_first=True)
        if quack_mlp_import_problem() is None:
            assert fuse_mlp(block) >= 1
    _chained(fused)
    hidden, context, temb = _sd3_medium_inputs(device)
    compared = ("ff.net.0.proj.bias", "ff.net.2.bias", "ff.net.2.weight", "attn.to_out.0.bias", "attn.to_add_out.bias",
                "ff_context.net.0.proj.bias", "ff_context.net.2.bias", "norm1.linear.weight", "norm1.linear.bias")
    results = {}
    for name, blocks in (("plain", plain), ("fused", fused), ("compiled", [torch.compile(b) for b in fused])):
        h, c = hidden.clone().requires_grad_(), context.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out_h, _ = _run_blocks(blocks, h, c, temb)
        out_h.float().square().mean().backward()
        modules = plain if name == "plain" else fused  # the compiled blocks are the fused ones, wrapped
        params = dict(modules[0].named_parameters())
        results[name] = (out_h.float(), h.grad, c.grad, *(params[n].grad.float() for n in compared))
        for block in modules:
            block.zero_grad(set_to_none=True)
    labels = ("out", "d image", "d context", *compared)
    for run in ("fused", "compiled"):
        for label, got, expected in zip(labels, results[run], results["plain"], strict=True):
            assert ((got - expected).norm() / expected.norm()).item() < 2e-2, f"{run}: {label}"
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        # the chain's second block: it takes (tokens, batch, channels) and hands the last a transposed view
        explained = torch._dynamo.explain(fused[1])(hidden.transpose(0, 1).contiguous(),
                                                   context.transpose(0, 1).contiguous(), temb)
    assert explained.graph_break_count == 0, explained.break_reasons


@needs_cuda
def test_fused_block_compiles_without_graph_breaks():
    device = torch.device("cuda")
    _, fused = _sd3_block_pair(device)
    hidden = torch.randn(2, 256, 1536, device=device)
    context, temb = torch.randn(2, 154, 1536, device=device), torch.randn(2, 1536, device=device)
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(fused)(hidden, context, temb)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
