import pytest
import torch
from sd3cluster.models import (
    EXPECTED_PARAMETERS,
    build_transformer,
    example_inputs,
    forward_flops,
    fuse_qkv,
)


def test_a_preset_whose_size_drifts_stops_the_build(monkeypatch: pytest.MonkeyPatch):
    """build_transformer checks every preset against its expected count; a config that drifts is refused."""
    monkeypatch.setitem(EXPECTED_PARAMETERS, "sd3-medium", 2_028_328_001)
    with pytest.raises(AssertionError, match="preset sd3-medium has 2,028,328,000 parameters, expected 2,028,328,001"):
        build_transformer("sd3-medium", device="meta")


def test_same_seed_same_init_on_every_rank():
    a, b = build_transformer("tiny", seed=3), build_transformer("tiny", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_fused_qkv_computes_the_same_function():
    torch.manual_seed(0)
    model = build_transformer("tiny").eval()
    inputs = example_inputs("tiny", 2, 32, 8, "cpu")
    with torch.no_grad():
        before = model(**inputs, return_dict=False)[0]
        fuse_qkv(model)
        after = model(**inputs, return_dict=False)[0]
    assert not hasattr(model.transformer_blocks[0].attn, "to_q")
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_forward_flops_sd3_medium_1024():
    flops = forward_flops("sd3-medium", 1, 1024, 154)
    assert 8.0e12 < flops < 9.0e12  # about 25 TFLOP per image per training step (x3)


def test_float8_takes_the_token_wise_linears_and_not_adaln():
    from sd3cluster.models import _float8_eligible

    model = fuse_qkv(build_transformer("sd3-medium", device="meta"))
    chosen = {name for name, module in model.named_modules() if _float8_eligible(module, name)}
    for i in range(24):
        assert {f"transformer_blocks.{i}.attn.to_qkv", f"transformer_blocks.{i}.ff.net.2"} <= chosen
        assert f"transformer_blocks.{i}.norm1.linear" not in chosen  # one row per sample: no fp8 GEMM
    assert not any(name.startswith(("context_embedder", "time_text_embed", "proj_out")) for name in chosen)
