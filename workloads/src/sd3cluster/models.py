"""SD3 MMDiT presets (diffusers' SD3Transformer2DModel), built with random init or from local weights."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention, packed_attention
from .errors import UserError
from .kernel_choice import choose_kernel
from .row_blocks import joined_linear, split_linear

# Configs of the published checkpoints' transformer/config.json; `tiny` is for CPU tests.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16, out_channels=16,
        pos_embed_max_size=16,
    ),
    "sd3-medium": dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
        joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=192,
    ),
    "sd35-medium": dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
        joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
    ),
    "sd35-large": dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
        joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=192, qk_norm="rms_norm",
    ),
}

# Parameter counts of the presets (random init); sd3-medium's is the published model's.
EXPECTED_PARAMETERS = {"sd3-medium": 2_028_328_000, "sd35-medium": 2_243_171_520, "sd35-large": 8_056_627_520}


def preset_config(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[preset])


def text_dims(preset: str) -> tuple[int, int]:
    """(joint_attention_dim, pooled_projection_dim): the widths of the text embeddings the model reads."""
    cfg = PRESETS[preset]
    return cfg["joint_attention_dim"], cfg["pooled_projection_dim"]


def build_transformer(preset: str, pretrained: Path | None = None, device: torch.device | str | None = None,
                      seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Random init (seeded, identical on every rank) or local diffusers weights; nothing is downloaded.

    Local weights are read in `dtype` on the host before they move to `device`, so a bf16 base (LoRA) never
    occupies the GPU in fp32: SD3.5-large's fp32 copy alone (30 GiB) would not fit the cards LoRA is for.
    Random init always draws in fp32 (then casts), so a preset's seeded weights are the same for every caller.
    """
    from diffusers import SD3Transformer2DModel

    if pretrained is not None:
        folder = Path(pretrained)
        if (folder / "transformer").is_dir():
            folder = folder / "transformer"
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--pretrained {pretrained}: no config.json there (nor in transformer/)")
        model = SD3Transformer2DModel.from_pretrained(folder, local_files_only=True, torch_dtype=dtype)
        return model.to(device) if device is not None else model
    cfg = preset_config(preset)
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(seed)
        model = SD3Transformer2DModel(**cfg)
    if dtype != torch.float32:
        model.to(dtype)
    expected = EXPECTED_PARAMETERS.get(preset)
    count = count_parameters(model)
    if expected is not None and count != expected:
        raise AssertionError(f"preset {preset} has {count:,} parameters, expected {expected:,}")
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class FusedJointAttnProcessor:
    """Joint attention with one q/k/v projection per stream; q, k and v stay in the projection's (batch, tokens,
    heads, head_dim) layout, which FlashAttention-4 reads as it is. `backend` is a resolved one (attention.py);
    `sequence_first`: the fused norms' blocks call joint_attention_sequence_first instead (model.layout), whose
    projections run on `projections` (model.projections resolved: torch or quack)."""

    def __init__(self, backend: str = "sdpa", sequence_first: bool = False, projections: str = "torch"):
        self.backend = backend
        self.sequence_first = sequence_first
        self.projections = projections

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
        batch, n_img, _ = hidden_states.shape
        heads = attn.heads
        q, k, v = attn.to_qkv(hidden_states).view(batch, n_img, 3, heads, -1).unbind(2)
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:
            n_txt = encoder_hidden_states.shape[1]
            cq, ck, cv = attn.to_added_qkv(encoder_hidden_states).view(batch, n_txt, 3, heads, -1).unbind(2)
            if attn.norm_added_q is not None:
                cq, ck = attn.norm_added_q(cq), attn.norm_added_k(ck)
            q, k, v = torch.cat([q, cq], 1), torch.cat([k, ck], 1), torch.cat([v, cv], 1)
        out = attention(q, k, v, self.backend).flatten(2)
        if encoder_hidden_states is None:
            return attn.to_out[0](out)
        img, txt = out[:, :n_img], out[:, n_img:]
        img = attn.to_out[0](img)
        if not attn.context_pre_only:
            txt = attn.to_add_out(txt)
        return img, txt


def sequence_first_backend(attn: nn.Module) -> str | None:
    """The attention backend when this joint attention runs in the sequence-first layout
    (joint_attention_sequence_first): fused with sequence_first (model.layout), without q/k norms (SD3.5's), with a
    context stream that has its own output projection; else None."""
    processor = getattr(attn, "processor", None)
    if not isinstance(processor, FusedJointAttnProcessor) or not processor.sequence_first:
        return None
    if attn.norm_q is not None or getattr(attn, "norm_added_q", None) is not None:
        return None
    if getattr(attn, "to_added_qkv", None) is None or getattr(attn, "to_add_out", None) is None:
        return None
    return processor.backend


def resolve_layout(name: str, fuse_qkv: bool, attention_backend: str, norm: str) -> tuple[str, str]:
    """(kind, why) for model.layout: sequence where FA4 and the fused norms run the joint blocks, else batch."""

    def problem() -> str | None:
        if not fuse_qkv:
            return "model.fuse_qkv=false"
        if attention_backend != "fa4":
            return f"the attention runs on {attention_backend}; FA4 reads the packed layout in place"
        if norm != "triton":
            return "model.norm resolved to torch; the fused norms' blocks run the layout"
        return None

    return choose_kernel("model.layout", name, "sequence", "q/k/v of both streams packed, FA4 in place", problem,
                         plain="batch")


def joint_attention_sequence_first(attn: nn.Module, image: torch.Tensor, context: torch.Tensor,
                                   backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                          torch.Tensor | None]:
    """FusedJointAttnProcessor's attention for (tokens, batch, channels) streams. Both projections' rows are whole
    blocks of one (tokens, batch, 3, heads, head_dim) tensor, which FA4 reads as q, k and v; its output's rows
    split into the two output projections' inputs as they are: no q/k/v is copied or stacked either way.
    Returns (image, context, image bias, context bias): plain output projections leave their biases to the caller
    (the fused norms' residual update adds them, fused_norm.gated_adaln), others apply them (None)."""
    n_img, batch, _ = image.shape
    projections = (attn.to_qkv, attn.to_added_qkv, attn.to_out[0], attn.to_add_out)
    plain = all(type(p) is nn.Linear for p in projections)  # LoRA's and float8's linears keep their forward
    quack = attn.processor.projections == "quack"
    if plain:  # each GEMM writes its rows of the joined tensor (row_blocks), no copy joins or splits them
        dtype = image.dtype  # the adaLN kernels' output: autocast's dtype where it is on
        weights = [p.weight.to(dtype) for p in projections]
        biases = [p.bias.to(dtype) if p.bias is not None else None for p in projections[:2]]
        qkv = joined_linear(image, context, weights[0], biases[0], weights[1], biases[1], quack)
    else:
        qkv = torch.cat([attn.to_qkv(image), attn.to_added_qkv(context)])
    out = packed_attention(qkv.view(qkv.shape[0], batch, 3, attn.heads, -1), backend).flatten(2)
    if plain:
        # the biases as the parameters they are: the fused norm adds them in fp32 and hands back their gradients
        return (*split_linear(out, n_img, weights[2], None, weights[3], None, quack), attn.to_out[0].bias,
                attn.to_add_out.bias)
    return attn.to_out[0](out[:n_img]), attn.to_add_out(out[n_img:]), None, None


@functools.cache
def quack_mlp_import_problem() -> str | None:
    """None when quack's fused MLP (a GEMM with the GELU in its epilogue, and the GELU's gradient in the epilogue of
    the backward's GEMM) imports, else why not. quack-kernels comes with the `fa4` extra."""
    try:
        from quack.mlp import mlp_func  # noqa: F401
    except Exception as e:  # an incomplete CUTLASS DSL install raises more than ImportError
        return f"{type(e).__name__}: {e}"
    return None


MLP_KINDS = ("auto", "torch", "quack")


def resolve_mlp(name: str, device: torch.device, half: bool, lora: bool) -> tuple[str, str]:
    """(kind, why): the feed-forward kernels `name` stands for. Raises UserError for quack where it cannot run.
    auto takes quack on sm90+ when it imports, for a half-precision full fine-tune (LoRA wraps the linears)."""
    if name not in MLP_KINDS:
        raise UserError(f"model.mlp={name!r}; choose one of {', '.join(MLP_KINDS)}")
    if name == "torch":
        return "torch", "torch (asked for)"
    cuda = device.type == "cuda"
    major = torch.cuda.get_device_capability(device)[0] if cuda else 0
    if name == "auto":
        why = ("not a CUDA device" if not cuda else f"sm{major}0 is older than Hopper" if major < 9
               else "fp32 training" if not half else "LoRA adapters on the linears" if lora
               else f"quack-kernels does not import ({quack_mlp_import_problem()})"
               if quack_mlp_import_problem() is not None else "")
        if why:
            return "torch", f"torch (auto: {why})"
        return "quack", f"quack (auto on sm{major}0: the GELU in the GEMMs' epilogues)"
    if not cuda or major < 9:
        raise UserError("model.mlp=quack needs a Hopper or newer GPU (sm90+); set model.mlp=auto or torch on this "
                        "device")
    if lora:
        raise UserError("model.mlp=quack fuses the feed-forward's linears, which LoRA adapts; set model.mlp=auto or "
                        "torch for train.mode=lora")
    if quack_mlp_import_problem() is not None:
        raise UserError(f"model.mlp=quack, but quack-kernels does not import ({quack_mlp_import_problem()}); "
                        "pip install 'sd3cluster[fa4]', or set model.mlp=auto or torch")
    return "quack", "quack (asked for)"


def resolve_projections(name: str, device: torch.device, half: bool, layout: str,
                        adapted_by: str | None = None) -> tuple[str, str]:
    """(kind, why) for model.projections: the sequence-first blocks' q/k/v and output projections of streams with
    many rows (row_blocks.QUACK_MIN_ROWS) on quack's GEMMs, the others on cuBLAS; auto takes quack on sm90+ when it
    imports, for half-precision training in the sequence-first layout with plain linears (`adapted_by` names what
    replaces them otherwise, LoRA's adapters or float8's linears, which keep their own forward)."""

    def problem() -> str | None:
        if device.type != "cuda":
            return "not a CUDA device"
        major = torch.cuda.get_device_capability(device)[0]
        if major < 9:
            return f"sm{major}0 is older than Hopper"
        if not half:
            return "fp32 training"
        if layout != "sequence":
            return "model.layout resolved to batch; the sequence-first blocks run these projections"
        if adapted_by:
            return f"{adapted_by} on the linears"
        return quack_mlp_import_problem()

    return choose_kernel("model.projections", name, "quack",
                         "the image stream's q/k/v and output projections on quack's GEMMs", problem)


def linear_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a CUDA linear layer computes x in: autocast's where it is on, else x's own."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype


def _fused_gelu_feed_forward(hidden_states: torch.Tensor, proj: nn.Linear, out: nn.Linear) -> torch.Tensor:
    """out(gelu_tanh(proj(x))) as two quack GEMMs: the GELU runs in the first GEMM's epilogue (which also keeps the
    pre-activation for the backward) and its gradient in the epilogue of the backward's GEMM, so no elementwise
    kernel reads or writes the 4x-wide hidden activation. Half precision (autocast's dtype) like nn.Linear."""
    from quack.mlp import mlp_func

    dtype = linear_compute_dtype(hidden_states)
    bias1 = proj.bias.to(dtype) if proj.bias is not None else None
    bias2 = out.bias.to(dtype) if out.bias is not None else None
    return mlp_func(hidden_states, proj.weight, out.weight, "gelu_tanh_approx", bias1=bias1, bias2=bias2)


def feed_forward_deferring_out_bias(ff: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor,
                                                                                        torch.Tensor | None]:
    """(ff(x) without its output projection's bias, that bias): the caller adds the bias where it costs no pass of
    its own (fused_norm.gated_residual adds it in the residual update and sums its gradient in the same pass, where
    the GEMM's backward would read the whole output gradient again for it). A feed-forward that is not diffusers'
    plain three-layer one with a plain biased output linear (LoRA adapts it, say) runs whole, with None."""
    from diffusers.models.attention import FeedForward

    net = getattr(ff, "net", None)
    if not isinstance(ff, FeedForward) or len(net) != 3 or type(net[2]) is not nn.Linear or net[2].bias is None:
        return ff(hidden_states), None
    if getattr(ff, "quack_applies", lambda _: False)(hidden_states):
        from .quack_mlp import gelu_mlp_without_out_bias  # the first bias's gradient in a GEMM's epilogue too

        return gelu_mlp_without_out_bias(hidden_states, net[0].proj, net[2]), net[2].bias
    return F.linear(net[1](net[0](hidden_states)), net[2].weight), net[2].bias


def fuse_mlp(model: nn.Module) -> int:
    """Run every tanh-GELU feed-forward of the transformer blocks through `_fused_gelu_feed_forward` (CUDA,
    half precision; anything else keeps diffusers' forward). The modules and their parameter names stay as they
    are, so checkpoints and exports do not change. Returns how many feed-forwards were fused."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    class FusedGeluFeedForward(FeedForward):
        def quack_applies(self, hidden_states: torch.Tensor) -> bool:
            half = torch.is_autocast_enabled() or hidden_states.dtype in (torch.bfloat16, torch.float16)
            plain = type(self.net[0].proj) is nn.Linear and type(self.net[2]) is nn.Linear  # not adapted
            return hidden_states.is_cuda and half and plain

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not self.quack_applies(hidden_states):
                return super().forward(hidden_states, *args, **kwargs)
            return _fused_gelu_feed_forward(hidden_states, self.net[0].proj, self.net[2])

    fused = 0
    for module in model.modules():
        if type(module) is not FeedForward or len(module.net) != 3:
            continue
        act, dropout = module.net[0], module.net[1]
        if isinstance(act, GELU) and act.approximate == "tanh" and dropout.p == 0:
            module.__class__ = FusedGeluFeedForward
            fused += 1
    return fused


@functools.cache
def _compute_dtype_final_norm() -> type:
    """diffusers' AdaLayerNormContinuous, its result in autocast's dtype where autocast is on (defined on first
    use, as diffusers is imported late)."""
    from diffusers.models.normalization import AdaLayerNormContinuous

    class ComputeDtypeAdaLayerNormContinuous(AdaLayerNormContinuous):
        def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
            out = super().forward(x, conditioning_embedding)
            if torch.is_autocast_enabled(out.device.type):
                return out.to(torch.get_autocast_dtype(out.device.type))
            return out

    return ComputeDtypeAdaLayerNormContinuous


def stream_ends_in_compute_dtype(model: nn.Module) -> list[nn.Module]:
    """The image stream's two ends outside the transformer blocks, for torch.compile (parallel.apply_compile): the
    patch embedding with its positions, and the final adaLN norm, which from here on hands proj_out its result in
    autocast's dtype (the cast proj_out's autocast made anyway, so the values are the same). Eager, under bf16
    autocast, each end is a chain of stream-sized kernels: the positions added in fp32 and cast back, the final
    LayerNorm, modulation and cast in fp32, and their gradients cast each way (in the kernel tables of
    benchmarks/sd3_training.md run 16: PyTorch's layer_norm kernels and bf16 copies, absent where these ends are
    compiled). Returns the modules found (none for a transformer without those diffusers modules)."""
    from diffusers.models.embeddings import PatchEmbed

    final_norm = _compute_dtype_final_norm()
    pos_embed, norm_out = getattr(model, "pos_embed", None), getattr(model, "norm_out", None)
    if type(norm_out) is final_norm.__base__:
        norm_out.__class__ = final_norm
    return [m for m, kind in ((pos_embed, PatchEmbed), (norm_out, final_norm)) if type(m) is kind]


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused


def fuse_qkv(model: nn.Module, attention_backend: str = "sdpa", sequence_first: bool = False,
             projections: str = "torch") -> nn.Module:
    """Replace to_q/to_k/to_v (and add_*_proj) by one linear each, keeping the same function; attention runs on
    `attention_backend`, a backend that attention.resolve_backend returned for the model's device, in the
    sequence-first layout where the fused norms' blocks can (`sequence_first`, model.layout resolved), with that
    layout's projections on `projections` (model.projections resolved)."""
    from diffusers.models.attention_processor import Attention

    for module in model.modules():
        if not isinstance(module, Attention) or not hasattr(module, "to_q"):
            continue
        module.to_qkv = _fused_linear([module.to_q, module.to_k, module.to_v])
        del module.to_q, module.to_k, module.to_v
        if getattr(module, "add_q_proj", None) is not None:
            module.to_added_qkv = _fused_linear([module.add_q_proj, module.add_k_proj, module.add_v_proj])
            del module.add_q_proj, module.add_k_proj, module.add_v_proj
        module.set_processor(FusedJointAttnProcessor(attention_backend, sequence_first, projections))
    return model


# Fused projection -> the diffusers names of its parts, in the order fuse_qkv concatenated them.
_FUSED_PARTS = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


def unfuse_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of fuse_qkv on a state dict: names and tensors as diffusers' SD3Transformer2DModel has them."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        module, _, leaf = key.rpartition(".")
        parent, _, name = module.rpartition(".")
        if name not in _FUSED_PARTS:
            out[key] = tensor
            continue
        for part_name, part in zip(_FUSED_PARTS[name], tensor.chunk(3, dim=0), strict=True):
            out[f"{parent}.{part_name}.{leaf}"] = part.clone()
    return out


def transformer_description(model: nn.Module, preset: str, fused: bool) -> dict[str, Any]:
    """What export needs to rebuild the trained module: its diffusers config and whether q/k/v were fused."""
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(model.config).items()
              if not k.startswith("_")}
    return {"preset": preset, "fuse_qkv": fused, "transformer_config": config}


def build_from_description(description: dict[str, Any], device: torch.device | str = "cpu") -> nn.Module:
    """The trained module's architecture (random weights), as `transformer_description` recorded it."""
    from diffusers import SD3Transformer2DModel

    config = dict(description["transformer_config"])
    if isinstance(config.get("dual_attention_layers"), list):
        config["dual_attention_layers"] = tuple(config["dual_attention_layers"])
    with torch.device(device):
        model = SD3Transformer2DModel(**config)
    if description.get("fuse_qkv"):
        fuse_qkv(model)
    return model


def _float8_eligible(module: nn.Module, name: str) -> bool:
    """The token-wise linears of the joint blocks: attention and MLP projections. Not the adaLN projections
    (one row per sample, far too small for an fp8 GEMM) and not layers whose widths fp8 GEMMs cannot take."""
    if not isinstance(module, nn.Linear) or not name.startswith("transformer_blocks."):
        return False
    if ".norm1" in name or "norm1_context" in name:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise") -> nn.Module:
    """Float8 GEMMs (torchao's float8 training, dynamic scaling) for the joint blocks' linears.

    The weights stay in their dtype (the optimizer's masters are unchanged); inputs, weights and output
    gradients are scaled and cast to float8 for each GEMM. Needs a GPU with fp8 tensor cores (sm_89+) and
    torchao; it is fast only under torch.compile, which fuses the scaling into the neighbouring kernels.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise RuntimeError("fp8 training needs torchao: pip install torchao (a version built for this torch)") from e
    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=_float8_eligible)


def example_inputs(preset: str, batch: int, resolution: int, text_tokens: int, device: torch.device | str,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    joint, pooled = text_dims(preset)
    side = resolution // 8
    return dict(
        hidden_states=torch.randn(batch, 16, side, side, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, joint, device=device, dtype=dtype),
        pooled_projections=torch.randn(batch, pooled, device=device, dtype=dtype),
        timestep=torch.rand(batch, device=device, dtype=dtype) * 1000,
    )


def forward_flops(preset: str, batch: int, resolution: int, text_tokens: int, fused: bool = False) -> float:
    """FLOPs of one forward pass, counted by torch.utils.flop_counter on the meta device (nothing allocated)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_transformer(preset, device="meta")
    if fused:
        fuse_qkv(model)
    inputs = example_inputs(preset, batch, resolution, text_tokens, "meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**inputs, return_dict=False)
    return float(counter.get_total_flops())


@functools.cache
def train_flops_per_image(preset: str, resolution: int, text_tokens: int) -> float:
    """FLOPs of a training step per image: the diffusers model's forward x 3 (forward + backward). MFU of `train`
    and of `bench` both divide this by the peak, whatever kernels or fusions the run uses."""
    return 3.0 * forward_flops(preset, 1, resolution, text_tokens)
