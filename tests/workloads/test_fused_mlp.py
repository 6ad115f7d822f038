"""The feed-forward through quack's fused GEMM + GELU kernels (model.mlp=quack) against diffusers' own.

The GPU tests run where CUDA, an sm90+ GPU and quack-kernels are present (the GPU machine: see
benchmarks/sd3_training.md for the command) and say skip elsewhere.
"""

import pytest
import torch
from sd3_helpers import hopper_skip_reason
from sd3cluster.config import Config
from sd3cluster.dist import local_runtime
from sd3cluster.errors import UserError
from sd3cluster.models import build_transformer, fuse_mlp, quack_mlp_import_problem, resolve_mlp
from sd3cluster.train import Trainer


def test_fuse_mlp_swaps_every_tanh_gelu_feed_forward_and_keeps_the_names():
    model = build_transformer("tiny")
    names = list(model.state_dict())
    # tiny: two joint blocks, the last one without a context feed-forward (context_pre_only).
    assert fuse_mlp(model) == 3
    assert list(model.state_dict()) == names
    assert type(model.transformer_blocks[0].ff).__name__ == "FusedGeluFeedForward"


def test_fused_feed_forward_keeps_diffusers_forward_on_a_cpu():
    """Off CUDA the fused class falls back to diffusers' forward: the same output to the last bit."""
    plain, fused = build_transformer("tiny"), build_transformer("tiny")
    fuse_mlp(fused)
    x = torch.randn(2, 5, plain.transformer_blocks[0].ff.net[0].proj.in_features)
    torch.testing.assert_close(fused.transformer_blocks[0].ff(x), plain.transformer_blocks[0].ff(x), rtol=0, atol=0)


def test_quack_mlp_on_a_cpu_stops_with_the_fix_named(tmp_path):
    cfg = Config.model_validate({"model": {"preset": "tiny", "mlp": "quack"},
                                 "data": {"synthetic_samples": 4, "resolution": 64}, "output": {"dir": str(tmp_path)}})
    with pytest.raises(UserError, match=r"model.mlp=quack needs a Hopper or newer GPU.*set model.mlp=auto or torch"):
        Trainer(cfg, local_runtime(torch.device("cpu")))


def test_auto_takes_torch_where_quack_cannot_run_and_says_why():
    cpu = torch.device("cpu")
    assert resolve_mlp("auto", cpu, half=False, lora=False) == ("torch", "torch (auto: not a CUDA device)")
    assert resolve_mlp("torch", cpu, half=False, lora=False)[0] == "torch"
    with pytest.raises(UserError, match="choose one of auto, torch, quack"):
        resolve_mlp("triton", cpu, half=False, lora=False)


def test_quack_feed_forward_leaves_lora_adapted_linears_to_diffusers():
    """An adapted linear is no plain nn.Linear: the fused class keeps diffusers' forward, adapters included."""
    model = build_transformer("tiny")
    fuse_mlp(model)
    ff = model.transformer_blocks[0].ff
    ff.net[2] = torch.nn.Sequential(ff.net[2])  # stands in for any wrapper: not a plain nn.Linear
    x = torch.randn(2, 5, ff.net[0].proj.in_features)
    torch.testing.assert_close(ff(x), ff.net[2](ff.net[1](ff.net[0](x))), rtol=0, atol=0)


def _quack_ready() -> str | None:
    return hopper_skip_reason("quack's fused MLP", quack_mlp_import_problem)


def test_fused_mlp_equals_diffusers_in_the_model_output_and_gradients():
    why = _quack_ready()
    if why:
        pytest.skip(why)
    from diffusers import SD3Transformer2DModel

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 16, 32, 32, device=device, generator=gen),
                  encoder_hidden_states=torch.randn(2, 24, 128, device=device, generator=gen),
                  pooled_projections=torch.randn(2, 64, device=device, generator=gen),
                  timestep=torch.tensor([100.0, 700.0], device=device))
    results = {}
    for kind in ("torch", "quack"):
        torch.manual_seed(0)  # the same fp32 weights for both; autocast as in training
        model = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=2,
                                      attention_head_dim=64, num_attention_heads=4, joint_attention_dim=128,
                                      caption_projection_dim=256, pooled_projection_dim=64, out_channels=16,
                                      pos_embed_max_size=32).to(device)
        if kind == "quack":
            assert fuse_mlp(model) == 3
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inputs, return_dict=False)[0]
        out.float().square().mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if ".ff" in n and p.grad is not None}
        results[kind] = (out.float(), grads)
    (out_t, grads_t), (out_q, grads_q) = results["torch"], results["quack"]
    # Both are bf16 GEMMs with fp32 accumulation and a tanh GELU: they differ by rounding, not by an error.
    assert (out_q - out_t).norm() / out_t.norm() < 2e-2
    assert grads_t.keys() == grads_q.keys() and len(grads_t) == 12  # 3 feed-forwards x 2 linears x weight, bias
    for name, grad in grads_t.items():
        assert (grads_q[name] - grad).norm() / grad.norm().clamp_min(1e-12) < 5e-2, name


@pytest.mark.parametrize("rows", [1232, 4096], ids=["ragged_rows", "whole_tiles"])
def test_gelu_mlp_op_takes_the_first_bias_gradient_in_its_epilogue(rows):
    """sd3cluster.quack_mlp (the feed-forward less its output bias, the first bias's gradient summed in the epilogue
    of the GEMM that writes the GELU's gradient) against fp32 PyTorch, eager and compiled into one graph; 1232 rows
    is the text stream's count at batch 8 (not a multiple of the GEMM's 128-row tiles)."""
    why = _quack_ready()
    if why:
        pytest.skip(why)
    import torch.nn.functional as F
    from sd3cluster.quack_mlp import gelu_mlp_without_out_bias

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(2)
    proj, out = torch.nn.Linear(256, 1024, device=device), torch.nn.Linear(1024, 256, device=device)
    proj.to(torch.bfloat16), out.to(torch.bfloat16)
    x = torch.randn(rows // 8, 8, 256, device=device, dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(rows // 8, 8, 256, device=device, dtype=torch.bfloat16, generator=gen)
    params = [proj.weight, proj.bias, out.weight]

    def reference():
        xf = x.float().requires_grad_()
        w1, b1, w2 = (p.detach().float().requires_grad_() for p in params)
        y = F.linear(F.gelu(F.linear(xf, w1, b1), approximate="tanh"), w2)
        return y, torch.autograd.grad((y * dout.float()).sum(), (xf, w1, b1, w2))

    def run(fn):
        xq = x.clone().requires_grad_()
        y = fn(xq, proj, out)
        grads = torch.autograd.grad((y.float() * dout.float()).sum(), (xq, *params))
        return y.float(), [g.float() for g in grads]

    y_ref, grads_ref = reference()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(gelu_mlp_without_out_bias)(x, proj, out)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    for fn in (gelu_mlp_without_out_bias, torch.compile(gelu_mlp_without_out_bias)):
        y, grads = run(fn)
        assert (y - y_ref).norm() / y_ref.norm() < 2e-2
        for name, g, r in zip(["x", "w1", "b1", "w2"], grads, grads_ref, strict=True):
            assert (g - r).norm() / r.norm() < 3e-2, name
