import json
import math
from types import SimpleNamespace

import pytest
from sd3cluster.bench import COPY_OPS, Variant, copy_ops, kernel_breakdown, run_bench
from sd3cluster.config import load_config


class _Trace:
    """The part of a torch.profiler result kernel_breakdown reads: per-kernel names and device times."""

    def __init__(self, kernels: dict[str, float]):
        self.kernels = kernels

    def key_averages(self):
        return [SimpleNamespace(key=k, self_device_time_total=us) for k, us in self.kernels.items()]


def test_kernel_breakdown_sorts_kernels_into_families_per_step():
    trace = _Trace({
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": 4000.0,
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": 3000.0,
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n": 1000.0,
        "triton_red_fused_native_layer_norm_0": 600.0,
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": 400.0,
        "Memset (Device)": 20.0,
        "aten::mm": 0.0,  # a CPU-side op: no device time of its own
    })
    ms = kernel_breakdown(trace, steps=2)
    assert ms == {"attention": 2.0, "gemm": 2.0, "optimizer": 0.2, "triton (fused elementwise/norm)": 0.3,
                  "other": 0.01}


def test_copy_ops_lists_the_copies_of_a_trace_by_input_shape():
    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(6, 4, 8)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            x.transpose(0, 1).contiguous()  # a transposed stream made contiguous: a copy each time
        x.clone()
        torch.mm(x[0], x[0].t())
    rows = {(row["op"], row["shapes"]): row["calls"] for row in copy_ops(prof)}
    assert rows[("aten::contiguous", "[[4, 6, 8], []]")] == 3
    assert rows[("aten::clone", "[[6, 4, 8], []]")] == 1
    assert rows[("aten::clone", "[[4, 6, 8], []]")] == 3
    assert not any(op == "aten::mm" for op, _ in rows)


def test_variant_options_parse_and_reject_unknown_keys():
    v = Variant.parse("optimized:fp8=tensorwise,batch=16,attn=cudnn")
    assert v.overrides == {"model.float8": "tensorwise", "data.batch_size": 16, "model.attention": "cudnn"}
    cfg = v.config(load_config(overrides=["model.preset=tiny", "data.batch_size=2"]))
    assert cfg.data.batch_size == 16 and cfg.model.attention == "cudnn" and cfg.model.fuse_qkv
    reference = Variant.parse("reference").config(load_config())
    assert (reference.model.fuse_qkv, reference.model.compile, reference.model.attention, reference.optim.fused) \
        == (False, False, "sdpa", False)
    with pytest.raises(ValueError, match="attn='fa3'; choose one of auto, fa4"):
        Variant.parse("optimized:attn=fa3")
    with pytest.raises(ValueError, match="unknown option 'fp9'"):
        Variant.parse("optimized:fp9=1")
    with pytest.raises(ValueError, match="unknown bench variant"):
        Variant.parse("fastest")


def test_bench_runs_the_training_step_of_train(tmp_path, capsys):
    """Both variants run train's Trainer (read-ahead data, per-sample noise, optimizer) on CPU with the tiny
    preset; the report holds finite numbers and says which attention each used."""
    cfg = load_config(overrides=["model.preset=tiny", "data.resolution=64", "data.batch_size=2", "bench.steps=2",
                                 "bench.warmup=1", "train.device=cpu", f"bench.report={tmp_path / 'bench.json'}"])
    results = run_bench(cfg)
    assert [r.variant for r in results] == ["reference", "optimized"]
    for r in results:
        assert r.images_per_s > 0 and r.mfu > 0 and math.isfinite(r.loss) and r.batch == 2
        assert math.isnan(r.peak_gib) and math.isnan(r.first_step_peak_gib)  # no memory counter to claim off CUDA
    assert "diffusers' processor" in results[0].extra["kernels"]
    assert results[1].extra["kernels"].startswith("attention: sdpa (auto on cpu")
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [r["variant"] for r in report] == ["reference", "optimized"]
    out = capsys.readouterr().out
    assert "| reference | tiny | 64 | 2 |" in out and "| first step's peak GiB |" in out


def test_run_variant_traces_the_copy_ops_of_one_more_step():
    import torch
    from sd3cluster.bench import run_variant

    cfg = load_config(overrides=["model.preset=tiny", "data.resolution=64", "data.batch_size=2", "bench.steps=1",
                                 "bench.warmup=1", "train.device=cpu"])
    result = run_variant(Variant.parse("optimized"), cfg, torch.device("cpu"), trace_copies=True)
    rows = result.extra["copy_ops"]
    assert rows and {row["op"] for row in rows} <= set(COPY_OPS)
    assert all(row["calls"] > 0 for row in rows)


def test_on_a_gpu_the_warm_steps_peak_leaves_out_what_the_first_step_held(monkeypatch):
    """The first step compiles and may autotune (quack's GEMMs hold buffers there on a machine without its cache):
    its peak is reported apart, so peak_gib is what a running step holds. A first step made to hold 1 GiB more."""
    import torch
    from sd3cluster import train as train_module
    from sd3cluster.bench import run_variant

    if not torch.cuda.is_available():
        pytest.skip("CUDA's memory counters")
    step_async, calls = train_module.Trainer.step_async, []

    def first_step_holds_more(self):
        if not calls:
            calls.append(torch.ones(2**28, device="cuda").sum())  # 1 GiB, freed before the step returns
        return step_async(self)

    monkeypatch.setattr(train_module.Trainer, "step_async", first_step_holds_more)
    cfg = load_config(overrides=["model.preset=tiny", "data.resolution=64", "data.batch_size=2", "bench.steps=2",
                                 "bench.warmup=2", "train.device=cuda"])
    result = run_variant(Variant.parse("optimized"), cfg, torch.device("cuda"))
    assert 0 < result.peak_gib < result.first_step_peak_gib - 0.9
