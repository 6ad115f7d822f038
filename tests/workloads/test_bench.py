from types import SimpleNamespace

import pytest
from sd3cluster.bench import Variant, kernel_breakdown


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


def test_variant_options_parse_and_reject_unknown_keys():
    v = Variant.parse("optimized:fp8=tensorwise,batch=16")
    assert v.options["fp8"] == "tensorwise" and v.options["batch"] == 16 and v.options["attn"] == "cudnn"
    with pytest.raises(ValueError, match="unknown option 'fp9'"):
        Variant.parse("optimized:fp9=1")
    with pytest.raises(ValueError, match="unknown bench variant"):
        Variant.parse("fastest")
