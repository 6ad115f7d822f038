"""AdamW with the gradient clip inside its pass: two Triton launches over every parameter of a run.

torch's fused AdamW and `clip_grad_norm_` go over a step's fp32 state in three passes: the gradient norm (a read of
SD3-medium's 8 GB of gradients), the clip's multiply (a read and a write of them), together about 6.7 ms on an H200,
and the update (16.5 ms at about 3.4 TB/s), each cut into about 100 launches of 320 blocks
(benchmarks/sd3_training.md, run 10). Here one launch sums the squares of every gradient, a partial per 4096
elements that torch adds up in a fixed order (so the norm is the same on every run), and one launch per parameter
group updates every parameter, applying the clip factor as it reads the gradient. A program finds its tensor in
small tables of pointers, so parameters and gradients stay where they are; the moments live in one flat buffer
and the optimizer's state holds views of it, so checkpoints hold exactly what torch's AdamW holds (`step`,
`exp_avg`, `exp_avg_sq` per parameter) and move between the two.

With fp32 masters (train.weights=bf16) the parameters the model computes with are bf16 and so are their gradients:
the update reads the bf16 gradient and the fp32 master, and writes the master and its bf16 copy into the parameter
in the same pass, so nothing casts weights to bf16 in the forward or gradients back to fp32 in the backward.

The arithmetic is torch's fused AdamW's: decoupled weight decay, then the moments, then
`p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)`. The kernels run on CUDA (and on the CPU
under Triton's interpreter, TRITON_INTERPRET=1, which the tests use).

Measured on an H200 (benchmarks/sd3_training.md, run 13): SD3-medium's optimizer share of a training step 16.2 ms
against torch's 23.3 (the update at about 3.9 TB/s), the step 428 ms against 434 (+1.2% images/s); the optimizer
step alone (benchmarks/adamw_kernels.py) 15.9 ms against 23.7.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch

from .kernel_choice import cannot_run, choose_kernel, triton_import_problem

CHUNK = 4096  # elements one program reads of each tensor: 16 KB of fp32, whole chunks of every large weight
NUM_WARPS = 8  # 16 values a thread: alone 4.1 TB/s on an H200, 2.9 at 4 warps; in the step both the same


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The two kernels, defined on first use so that importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_grad_square_sum(GRAD_PTRS, CHUNK_TENSOR, CHUNK_FIRST, NUMEL, PARTIAL, BF16: tl.constexpr,
                              ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        chunk = tl.program_id(0)
        tensor = tl.load(CHUNK_TENSOR + chunk)
        # the chunk's first element inside its tensor: a multiple of BLOCK, which the compiler can see
        offsets = (chunk - tl.load(CHUNK_FIRST + tensor)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        numel, grad = tl.load(NUMEL + tensor), tl.load(GRAD_PTRS + tensor)
        if ALIGNED:  # 16-byte addresses and sizes in fours: the compiler may read four values at a time
            numel, grad = tl.multiple_of(numel, 4), tl.multiple_of(grad, 16)
        mask = offsets < numel
        grad = grad.to(tl.pointer_type(tl.bfloat16 if BF16 else tl.float32))
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(PARTIAL + chunk, tl.sum(g * g, axis=0))

    @triton.jit
    def adamw_update(PARAM_PTRS, GRAD_PTRS, WEIGHT_PTRS, CHUNK_TENSOR, CHUNK_FIRST, NUMEL, OFFSET, EXP_AVG,
                     EXP_AVG_SQ, CLIP, lr_decay, beta1, beta2, step_size, bias_correction2_sqrt, eps,
                     HAS_CLIP: tl.constexpr, BF16: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        # BF16: PARAM_PTRS are fp32 masters, the gradients bf16, and the model's bf16 weights (WEIGHT_PTRS) are
        # written from the updated masters in the same pass; otherwise WEIGHT_PTRS is not read.
        chunk = tl.program_id(0)
        tensor = tl.load(CHUNK_TENSOR + chunk)
        offsets = (chunk - tl.load(CHUNK_FIRST + tensor)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        numel, start = tl.load(NUMEL + tensor), tl.load(OFFSET + tensor)
        param, grad = tl.load(PARAM_PTRS + tensor), tl.load(GRAD_PTRS + tensor)
        if ALIGNED:
            numel, start = tl.multiple_of(numel, 4), tl.multiple_of(start, 4)
            param, grad = tl.multiple_of(param, 16), tl.multiple_of(grad, 16)
        mask = offsets < numel
        param = param.to(tl.pointer_type(tl.float32))
        grad = grad.to(tl.pointer_type(tl.bfloat16 if BF16 else tl.float32))
        flat = start + offsets
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_CLIP:
            g = g * tl.load(CLIP)
        p = tl.load(param + offsets, mask=mask, other=0.0)
        p = p - lr_decay * p  # as torch's: lr x weight decay kept whole, not rounded into a factor near 1
        m = beta1 * tl.load(EXP_AVG + flat, mask=mask, other=0.0) + (1.0 - beta1) * g
        v = beta2 * tl.load(EXP_AVG_SQ + flat, mask=mask, other=0.0) + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
        tl.store(param + offsets, p, mask=mask)
        if BF16:
            weight = tl.load(WEIGHT_PTRS + tensor)
            if ALIGNED:
                weight = tl.multiple_of(weight, 16)
            # rounded to nearest even on the GPU (Triton's CPU interpreter truncates instead)
            tl.store(weight.to(tl.pointer_type(tl.bfloat16)) + offsets, p.to(tl.bfloat16), mask=mask)
        tl.store(EXP_AVG + flat, m, mask=mask)
        tl.store(EXP_AVG_SQ + flat, v, mask=mask)

    return adamw_grad_square_sum, adamw_update


def kernel_problem(params: Iterable[torch.Tensor], masters: dict[torch.Tensor, torch.Tensor] | None = None
                   ) -> str | None:
    """None when the Triton AdamW can step these parameters, else why not. It reads dense, contiguous tensors of
    one device through raw pointers: fp32 parameters, or with `masters` bf16 parameters each with an fp32 master of
    its shape (FSDP's sharded DTensors go to torch's AdamW)."""
    params = list(params)
    if not params:
        return "no parameters to train"
    for p in params:
        if type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor:
            return f"a parameter is a {type(p).__name__} (FSDP's shards step with torch's AdamW)"
        if masters is None:
            if p.dtype != torch.float32:
                return f"a parameter is {p.dtype}, the kernels update fp32 weights (or bf16 ones with fp32 masters)"
        else:
            master = masters.get(p)
            if master is None or p.dtype != torch.bfloat16:
                return f"a parameter is {p.dtype}{' without an fp32 master' if master is None else ''}; with masters " \
                       "every parameter is bf16 and has one"
            if master.dtype != torch.float32 or master.shape != p.shape or master.device != p.device or \
                    not master.is_contiguous():
                return "a master is not a contiguous fp32 tensor of its parameter's shape and device"
        if not p.is_contiguous() or p.layout != torch.strided:
            return "a parameter is not a dense contiguous tensor"
        if p.device != params[0].device:
            return "the parameters are on more than one device"
    return None


def resolve_adamw_kernel(name: str, optimizer: str, fused: bool, device: torch.device,
                         params: list[torch.Tensor], sharded: bool = False) -> tuple[str, str]:
    """(kind, why) for optim.kernel: triton (this module) or torch (torch's AdamW, fused when optim.fused, and
    clip_grad_norm_). auto takes triton for optim.optimizer=adamw with optim.fused on CUDA when Triton imports and
    the parameters are plain fp32 tensors that FSDP will not shard (`sharded`)."""

    def problem() -> str | None:
        if optimizer != "adamw":
            return f"optim.optimizer={optimizer} is not torch's AdamW"
        if not fused:
            return "optim.fused=false asks for torch's unfused AdamW"
        if device.type != "cuda":
            return "not a CUDA device"
        if sharded:
            return "FSDP's shards step with torch's AdamW"
        return triton_import_problem() or kernel_problem(params)

    return choose_kernel("optim.kernel", name, "triton", "AdamW and the gradient clip in two launches", problem)


def resolve_weights(name: str, adamw_kernel: str, bf16_compute: bool, mode: str, float8: str,
                    grad_accum: int) -> tuple[str, str]:
    """(kind, why) for train.weights: bf16 (the model's weights and gradients in bf16, fp32 masters in the Triton
    AdamW, which writes the bf16 copy as it updates) or fp32 (fp32 weights, cast to bf16 by autocast at every use
    and their gradients cast back). auto takes bf16 where all of these hold."""

    def problem() -> str | None:
        if not bf16_compute:
            return "bf16 weights need bf16 compute: train.precision=bf16 on a GPU"
        if mode == "lora":
            return "train.mode=lora trains fp32 adapters on a frozen base (lora.base_dtype sets the base's dtype)"
        if float8 != "none":
            return f"model.float8={float8} casts fp32 weights itself"
        if grad_accum > 1:
            return f"train.grad_accum={grad_accum} would sum the micro-batches' gradients in bf16"
        if adamw_kernel != "triton":
            return "optim.kernel resolved to torch; the fp32 masters live in the Triton AdamW"
        return None

    return choose_kernel("train.weights", name, "bf16", "bf16 weights and gradients, fp32 masters in the optimizer",
                         problem, plain="fp32")


def bf16_weights_with_fp32_masters(params: Iterable[torch.nn.Parameter]) -> dict[torch.Tensor, torch.Tensor]:
    """Turn each parameter into bf16 and return {parameter: its former fp32 tensor, now its master}. The
    Parameter objects stay the same, so modules, DDP (built after this) and the optimizer hold the one tensor; call
    it before DDP, whose buckets take the gradients' dtype when it is built."""
    masters: dict[torch.Tensor, torch.Tensor] = {}
    with torch.no_grad():
        for p in params:
            if p.dtype != torch.float32:
                raise ValueError(f"bf16_weights_with_fp32_masters: a parameter is {p.dtype}, expected fp32")
            master = p.data
            p.data = master.to(torch.bfloat16)
            masters[p] = master
    return masters


class _Tables:
    """Where each program of a launch over some parameters reads: its tensor, that tensor's first chunk, size and
    place in the flat moments (device tensors, built once), and the data pointers of the parameters and their
    gradients, sent again only when they move (a gradient set to None is allocated again by the next backward,
    mostly at the same address)."""

    def __init__(self, params: list[torch.Tensor], offsets: list[int], device: torch.device):
        self.chunk = CHUNK  # the launches' BLOCK: the tables are cut in these
        numel = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        per_tensor = (numel + self.chunk - 1) // self.chunk
        self.chunks = int(per_tensor.sum())
        self.device = device
        self.chunk_tensor = self._to_device(torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32),
                                                                    per_tensor))
        self.chunk_first = self._to_device(torch.cumsum(per_tensor, 0) - per_tensor)
        self.numel = self._to_device(numel)
        self.offset = self._to_device(torch.tensor(offsets, dtype=torch.int64))
        self._sizes_in_fours = bool((numel % 4 == 0).all()) and all(o % 4 == 0 for o in offsets)
        self._sent: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t
        # pinned, so the copy is queued behind the step's kernels instead of waiting for them
        return t.pin_memory().to(self.device, non_blocking=True)

    def pointers(self, role: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(t.data_ptr() for t in tensors)
        sent = self._sent.get(role)
        if sent is None or sent[0] != key:
            sent = self._sent[role] = (key, self._to_device(torch.tensor(key, dtype=torch.int64)))
        return sent[1]

    def aligned(self) -> bool:
        """Every size and flat offset a multiple of 4 and every pointer sent of 16 bytes (the kernels' ALIGNED)."""
        return self._sizes_in_fours and all(p % 16 == 0 for key, _ in self._sent.values() for p in key)


class TritonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update and state, stepped by two Triton launches (see the module's docstring).

    `step(max_norm=...)` clips the gradients to that total norm as it updates (0: no clip) and leaves the
    gradients' total norm, before the clip, in `grad_norm` (a device tensor, so reading it is the only wait).

    `masters` ({bf16 parameter: fp32 master}, from bf16_weights_with_fp32_masters): the kernels read the bf16
    gradients, update the masters and write each parameter as its master rounded to bf16. The masters are not in
    this optimizer's state dict (it stays torch's AdamW's); whoever saves the run saves them in the model's place
    (Trainer.tensor_state), so a checkpoint holds what an fp32 run holds."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2,
                 masters: dict[torch.Tensor, torch.Tensor] | None = None):
        # torch's AdamW's group keys (amsgrad, maximize, ...), so a checkpoint of either loads into the other
        defaults = dict(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults)
        defaults.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self._params = [p for group in self.param_groups for p in group["params"]]
        problem = kernel_problem(self._params, masters)
        if problem:
            raise cannot_run("optim.kernel", "triton", problem)
        self._device = self._params[0].device
        self.masters = masters
        self._offsets: dict[torch.Tensor, int] = {}
        total = 0
        for p in self._params:
            self._offsets[p] = total
            total += p.numel()
        self._exp_avg = torch.zeros(total, dtype=torch.float32, device=self._device)
        self._exp_avg_sq = torch.zeros_like(self._exp_avg)
        for p in self._params:
            self.state[p] = {"step": torch.tensor(0.0), "exp_avg": self._moment(self._exp_avg, p),
                             "exp_avg_sq": self._moment(self._exp_avg_sq, p)}
        self._tables: dict[tuple[int, ...], _Tables] = {}
        self.grad_norm = torch.zeros((), device=self._device)

    def _moment(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        start = self._offsets[p]
        return flat[start:start + p.numel()].view_as(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading, then the given moments copied into the flat buffers the kernels update. They are copied
        from the state dict as given: torch's loading casts them to their parameter's dtype (bf16 with masters)."""
        given = state_dict["state"]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        super().load_state_dict(state_dict)  # checks that the groups match; maps ids to parameters in this order
        for i, p in zip(ids, self._params, strict=True):
            loaded = given.get(i, {})  # empty where torch's AdamW never stepped the parameter (it had no gradient)
            state = self.state[p]
            for key, flat in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                view = self._moment(flat, p)
                if key not in loaded:
                    view.zero_()
                elif loaded[key].data_ptr() != view.data_ptr():
                    view.copy_(loaded[key])
                state[key] = view
            # a count of its own on the host (torch keeps the loaded tensor, which may be the source's own)
            state["step"] = torch.tensor(float(loaded.get("step", 0.0)))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_params"):  # torch's __init__ adds the first groups; the flat moments are sized then
            raise ValueError("TritonAdamW sizes its moments at construction; build it with every parameter group")
        super().add_param_group(param_group)

    def _table(self, params: list[torch.Tensor]) -> _Tables:
        key = tuple(id(p) for p in params)
        if key not in self._tables:
            if len(self._tables) >= 16:  # sets of parameters with gradients come and go: keep the recent ones
                self._tables.pop(next(iter(self._tables)))
            self._tables[key] = _Tables(params, [self._offsets[p] for p in params], self._device)
        return self._tables[key]

    @staticmethod
    def _gradient(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g.dtype != p.dtype or g.device != p.device:
            raise RuntimeError(f"TritonAdamW: a gradient is {g.dtype} on {g.device}, expected {p.dtype} on {p.device}")
        return g if g.is_contiguous() else g.contiguous()

    @torch.no_grad()
    def step(self, closure: Any = None, max_norm: float = 0.0) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("TritonAdamW.step takes no closure")
        square_sum, update = _kernels()
        live = [p for p in self._params if p.grad is not None]
        if not live:
            self.grad_norm = torch.zeros((), device=self._device)
            return
        grads = {p: self._gradient(p) for p in live}
        table = self._table(live)
        partial = torch.empty(table.chunks, dtype=torch.float32, device=self._device)
        grad_ptrs = table.pointers("grad", [grads[p] for p in live])
        square_sum[(table.chunks,)](grad_ptrs, table.chunk_tensor, table.chunk_first, table.numel, partial,
                                    BF16=self.masters is not None, ALIGNED=table.aligned(), BLOCK=table.chunk,
                                    num_warps=NUM_WARPS)
        self.grad_norm = partial.sum().sqrt()
        # without a clip the kernel never reads CLIP; the norm's tensor stands in for the pointer
        clip = (max_norm / (self.grad_norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else self.grad_norm
        for group in self.param_groups:
            # torch's AdamW counts steps per parameter (one without a gradient does not step): one launch for
            # the parameters of each count, in practice one for the whole group.
            by_step: dict[float, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_step.setdefault(float(self.state[p]["step"]), []).append(p)
            for done, members in by_step.items():
                self._update(update, group, done + 1, members, grads, clip, max_norm > 0)
                torch._foreach_add_([self.state[p]["step"] for p in members], 1.0)

    def _update(self, kernel: Any, group: dict[str, Any], step: float, members: list[torch.Tensor],
                grads: dict[torch.Tensor, torch.Tensor], clip: torch.Tensor, has_clip: bool) -> None:
        lr, (beta1, beta2), eps = float(group["lr"]), group["betas"], group["eps"]
        table = self._table(members)
        grad_ptrs = table.pointers("grad", [grads[p] for p in members])
        if self.masters is None:
            param_ptrs = weight_ptrs = table.pointers("param", members)
        else:  # the masters are updated; the parameters are their bf16 copies
            param_ptrs = table.pointers("param", [self.masters[p] for p in members])
            weight_ptrs = table.pointers("weight", members)
        kernel[(table.chunks,)](
            param_ptrs, grad_ptrs, weight_ptrs, table.chunk_tensor, table.chunk_first, table.numel, table.offset,
            self._exp_avg, self._exp_avg_sq, clip, lr * group["weight_decay"], beta1, beta2,
            lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step), eps, HAS_CLIP=has_clip,
            BF16=self.masters is not None, ALIGNED=table.aligned(), BLOCK=table.chunk, num_warps=NUM_WARPS)
