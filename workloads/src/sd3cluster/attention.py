"""The attention kernel of SD3's joint attention, one choice for train, bench, generate and serve.

Backends (model.attention): `fa4` FlashAttention-4 (CuTe DSL kernels, sm90+; the optional extra `fa4`),
`cudnn` cuDNN's fused attention, `flash` PyTorch's FlashAttention-2, `sdpa` PyTorch's own dispatch (the only
one on a CPU), and `auto`: fa4 on sm90+ when it imports, else cudnn on CUDA, else sdpa.

Every backend takes and returns (batch, tokens, heads, head_dim), the layout the fused q/k/v projection writes,
so FA4 (which reads that layout) needs no transposes. FA4 is registered as a PyTorch custom op with its backward,
so torch.compile keeps a whole transformer block in one graph around it; its own autograd.Function would break
the graph at every call. Measured on one H200 at SD3-medium's 1024^2 shape (B 8, 24 heads, 4250 tokens, d 64):
forward+backward 472 TFLOP/s for FA4 against 392 for cuDNN and 257 for FlashAttention-2.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .errors import UserError

BACKENDS = ("auto", "fa4", "cudnn", "flash", "sdpa")
# What `pip install sd3cluster[fa4]` brings; named in the message when fa4 is asked for and missing.
FA4_INSTALL = "pip install 'sd3cluster[fa4]' (flash-attn-4 4.0.0b36 and nvidia-cutlass-dsl 4.8.1)"


@functools.cache
def fa4_import_problem() -> str | None:
    """None when FlashAttention-4's interface imports, else why not (a missing package, a broken install)."""
    try:
        from flash_attn.cute import interface  # noqa: F401
    except Exception as e:  # an incomplete CUTLASS DSL install raises more than ImportError
        return f"{type(e).__name__}: {e}"
    return None


def resolve_backend(name: str, device: torch.device) -> tuple[str, str]:
    """(backend, why): the kernel `name` stands for on `device`. Raises UserError for a kernel the device lacks."""
    if name not in BACKENDS:
        raise UserError(f"model.attention={name!r}; choose one of {', '.join(BACKENDS)}")
    cuda = device.type == "cuda"
    major = torch.cuda.get_device_capability(device)[0] if cuda else 0
    if name == "auto":
        if not cuda:
            return "sdpa", f"sdpa (auto on {device.type}: PyTorch's scaled_dot_product_attention)"
        if major >= 9 and fa4_import_problem() is None:
            return "fa4", f"fa4 (auto on sm{major}0: FlashAttention-4)"
        why = f"sm{major}0 is older than Hopper" if major < 9 else \
            f"flash-attn-4 does not import ({fa4_import_problem()})"
        return "cudnn", f"cudnn (auto: cuDNN fused attention; {why})"
    if name in ("fa4", "cudnn", "flash") and not cuda:
        raise UserError(f"model.attention={name} runs on CUDA devices only; this run is on {device.type}: use auto "
                        "or sdpa")
    if name == "fa4":
        if major < 9:
            raise UserError(f"model.attention=fa4 needs a Hopper or newer GPU (sm90+); this one is sm{major}0: use "
                            "auto or cudnn")
        if fa4_import_problem() is not None:
            raise UserError(f"model.attention=fa4, but flash-attn-4 does not import ({fa4_import_problem()}); "
                            f"{FA4_INSTALL}, or use auto or cudnn")
    return name, f"{name} (asked for; fp32 inputs go to sdpa)"


HALF_PRECISION = (torch.bfloat16, torch.float16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """Non-causal attention over (batch, tokens, heads, head_dim) inputs; the output has the same layout.
    fa4, cudnn and flash are half-precision kernels: fp32 inputs (train.precision=fp32, an fp32 pipeline) go
    to PyTorch's dispatch, which has fp32 kernels."""
    if q.dtype not in HALF_PRECISION:
        backend = "sdpa"
    if backend == "fa4":
        return torch.ops.sd3cluster.fa4_attention(q.contiguous(), k.contiguous(), v.contiguous())[0]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if backend == "cudnn":
        # Called directly, not through sdpa_kernel(): the backend flags are no part of torch.compile's guards.
        # The log-sum-exp is written only when a backward pass will read it.
        keep_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, keep_lse, 0.0, False, False)[0]
    elif backend == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
    else:
        out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2)


# -- FlashAttention-4 as a custom op ---------------------------------------------------------------------------
# Registered at import on every machine (the kernels are imported only when the op runs), so a graph that names
# the op can be traced anywhere; only running it needs flash-attn-4 and an sm90+ GPU.

@torch.library.custom_op("sd3cluster::fa4_attention", mutates_args=())
def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (B, S, H, D) in q's dtype, lse (B, H, S) fp32, the log-sum-exp the backward reads."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(q, k, v, return_lse=True)
    return out, lse


@fa4_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, tokens, heads, _ = q.shape
    out = q.new_empty((batch, tokens, heads, v.shape[-1]))
    return out, q.new_empty((batch, heads, tokens), dtype=torch.float32)


@torch.library.custom_op("sd3cluster::fa4_attention_backward", mutates_args=())
def fa4_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse)
    return dq, dk, dv


@fa4_attention_backward.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
      lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_setup_context(ctx, inputs, output) -> None:
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _fa4_backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    return fa4_attention_backward(dout.contiguous(), q, k, v, out, lse)


fa4_attention.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)


# The sequence-first packed layout: q, k and v of every token interleaved in one (tokens, batch, 3, heads, head_dim)
# tensor, as the joint blocks' two projections write it (models.joint_attention_sequence_first). FA4 reads q, k and v
# and writes the output and the gradients through strided views, so neither direction copies q, k and v into
# separate tensors or stacks their gradients back (about 7 ms of copies a step for SD3-medium at 1024^2 otherwise).

def _unpacked(qkv: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v of a packed (tokens, batch, 3, heads, head_dim) tensor as (batch, tokens, heads, head_dim) views."""
    return [qkv[:, :, i].transpose(0, 1) for i in range(3)]


@torch.library.custom_op("sd3cluster::fa4_attention_packed", mutates_args=())
def fa4_attention_packed(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (tokens, batch, heads, head_dim) in qkv's dtype, lse (batch, heads, tokens) fp32."""
    from flash_attn.cute.interface import _flash_attn_fwd

    tokens, batch, _, heads, head_dim = qkv.shape
    out = qkv.new_empty((tokens, batch, heads, head_dim))
    _, lse, *_ = _flash_attn_fwd(*_unpacked(qkv), out=out.transpose(0, 1), return_lse=True)
    return out, lse


@fa4_attention_packed.register_fake
def _(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, batch, _, heads, head_dim = qkv.shape
    return qkv.new_empty((tokens, batch, heads, head_dim)), qkv.new_empty((batch, heads, tokens), dtype=torch.float32)


@torch.library.custom_op("sd3cluster::fa4_attention_packed_backward", mutates_args=())
def fa4_attention_packed_backward(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor,
                                  lse: torch.Tensor) -> torch.Tensor:
    """d(qkv) in qkv's packed layout, written by FA4's backward through strided views."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dqkv = torch.empty_like(qkv)
    dq, dk, dv = _unpacked(dqkv)
    _flash_attn_bwd(*_unpacked(qkv), out.transpose(0, 1), dout.transpose(0, 1), lse, dq=dq, dk=dk, dv=dv)
    return dqkv


@fa4_attention_packed_backward.register_fake
def _(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(qkv)


def _fa4_packed_setup_context(ctx, inputs, output) -> None:
    (qkv,) = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)


def _fa4_packed_backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
    qkv, out, lse = ctx.saved_tensors
    return fa4_attention_packed_backward(dout.contiguous(), qkv, out, lse)


fa4_attention_packed.register_autograd(_fa4_packed_backward, setup_context=_fa4_packed_setup_context)


def packed_attention(qkv: torch.Tensor, backend: str) -> torch.Tensor:
    """Attention over a packed (tokens, batch, 3, heads, head_dim) tensor; the output is (tokens, batch, heads,
    head_dim). fa4 reads and writes the packed layout in place; other backends get views (and may copy)."""
    if backend == "fa4" and qkv.dtype in HALF_PRECISION:
        return torch.ops.sd3cluster.fa4_attention_packed(qkv)[0]
    return attention(*_unpacked(qkv), backend).transpose(0, 1)
