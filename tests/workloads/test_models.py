import pytest
import torch
from sd3cluster.models import (
    EXPECTED_PARAMETERS,
    build_transformer,
    example_inputs,
    forward_flops,
    fuse_qkv,
    stream_ends_in_compute_dtype,
)
from sd3cluster.parallel import apply_compile


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


def test_the_stream_ends_hand_on_autocasts_dtype_and_compile_with_the_blocks_to_the_same_values():
    """apply_compile compiles the patch embedding and the final norm besides the blocks; under bf16 autocast the
    final norm's result is already bf16 (proj_out's input cast, moved into the compiled graph), outside it fp32 as
    before; outputs and gradients equal the eager model's within bf16 rounding, and neither end breaks its graph."""
    import copy

    torch.manual_seed(0)
    eager = build_transformer("tiny")
    compiled = copy.deepcopy(eager)
    ends = stream_ends_in_compute_dtype(compiled)
    assert [type(m).__name__ for m in ends] == ["PatchEmbed", "ComputeDtypeAdaLayerNormContinuous"]
    assert stream_ends_in_compute_dtype(compiled) == ends  # a second call changes nothing
    x, temb = torch.randn(2, 16, 16), torch.randn(2, 16)
    assert compiled.norm_out(x, temb).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled.norm_out(x, temb).dtype == torch.bfloat16
        assert eager.norm_out(x, temb).dtype == torch.float32  # what proj_out's autocast cast before
        for end, args in ((compiled.pos_embed, (torch.randn(2, 16, 8, 8),)), (compiled.norm_out, (x, temb))):
            torch._dynamo.reset()
            explained = torch._dynamo.explain(end)(*args)
            assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    apply_compile(compiled)
    inputs = example_inputs("tiny", 2, 64, 8, "cpu")
    results = []
    for model in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**inputs, return_dict=False)[0]
        out.float().square().mean().backward()
        results.append((out.float(), {n: p.grad for n, p in model.named_parameters()}))
    (out_e, grads_e), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_e, rtol=2e-2, atol=2e-2)
    for name in ("pos_embed.proj.weight", "norm_out.linear.weight", "proj_out.weight"):
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=5e-2, atol=5e-3)


def test_compile_caches_are_keyed_by_the_custom_ops_sources(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """apply_compile tags torch.compile's caches with a hash of the custom ops' modules: a changed module gives
    another tag, a second call replaces its own tag instead of adding one, and a tag of the user's stays."""
    import shutil

    from sd3cluster import parallel

    before = torch.compiler.config.cache_key_tag  # an earlier apply_compile in this process may have set it
    # torch's own patch, not monkeypatch's: undoing that deletes the setting, which torch then hides from Inductor
    with torch.compiler.config.patch(cache_key_tag="users-tag"):
        apply_compile(build_transformer("tiny"))
        first = parallel.tag_compile_caches()
        assert torch.compiler.config.cache_key_tag == f"users-tag,{first}"
        for name in parallel.CUSTOM_OP_MODULES:  # the same sources elsewhere: the same tag
            shutil.copy(parallel.Path(parallel.__file__).parent / f"{name}.py", tmp_path)
        monkeypatch.setattr(parallel, "__file__", str(tmp_path / "parallel.py"))
        assert parallel.tag_compile_caches() == first
        with open(tmp_path / "fused_norm.py", "a") as changed:
            changed.write("\n# another version\n")
        second = parallel.tag_compile_caches()
        assert second != first and second.startswith("sd3cluster-ops-")
        assert torch.compiler.config.cache_key_tag == f"users-tag,{second}"
    assert torch.compiler.config.cache_key_tag == before


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
