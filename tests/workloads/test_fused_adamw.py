"""The Triton AdamW (optim.kernel=triton) against torch's AdamW after clip_grad_norm_, and through the Trainer.

The kernel tests run on the CPU under Triton's interpreter where Triton is installed (conftest.py turns it on without
a GPU) and say skip elsewhere; on the GPU machine the same tests compare the compiled kernels with torch's fused
AdamW on CUDA (benchmarks/sd3_training.md has the command).
"""

import copy
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
from sd3_helpers import TINY, bf16_as_kernel_rounds
from sd3cluster.config import load_config
from sd3cluster.dist import local_runtime
from sd3cluster.errors import UserError
from sd3cluster.fused_adamw import (
    CHUNK,
    TritonAdamW,
    bf16_weights_with_fp32_masters,
    kernel_problem,
    resolve_adamw_kernel,
    resolve_weights,
)
from sd3cluster.optim import make_warmup

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
kernels = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or (DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs a GPU or Triton's interpreter (Triton installed, no GPU)")

# Sizes that end inside a chunk, fill whole chunks, are smaller than one, and a matrix over several chunks.
SHAPES = [(37,), (2 * CHUNK,), (3, 3, 3), (96, 130), (CHUNK + 5,)]


def _pairs(seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES]
    return a, [torch.nn.Parameter(p.detach().clone()) for p in a]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Two groups with their own lr and weight decay (LoRA's groups have their own lr)."""
    return [{"params": params[:2], "lr": 3e-2, "weight_decay": 0.1}, {"params": params[2:], "lr": 1e-2}]


def _set_grads(a, b, step: int, skip: int | None = None) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        g = (torch.randn(x.shape, generator=gen) * 4).to(DEVICE)
        x.grad, y.grad = (None, None) if i == skip else (g.to(x.dtype, copy=True), g.to(y.dtype, copy=True))


def _assert_same(torch_opt, ours, a, b) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
        # moments of gradients about 4 (squares about 16): fp32 rounding apart, as torch's own kernels differ
        for key, atol in (("exp_avg", 1e-6), ("exp_avg_sq", 1e-5)):
            torch.testing.assert_close(ours.state[y][key], torch_opt.state[x][key], rtol=1e-5, atol=atol)
        assert float(ours.state[y]["step"]) == float(torch_opt.state[x]["step"])


def _three_steps(reference, ours, a, b, max_norm: float) -> float:
    """Three steps of both optimizers on the same gradients; in the second, parameter 1 has none. The reference
    clips with clip_grad_norm_ (where max_norm > 0); the norms must agree. Returns the last norm."""
    for step in range(3):
        _set_grads(a, b, step, skip=1 if step == 1 else None)
        for x, y in zip(a, b, strict=True):
            if y.grad is not None and y.grad.dtype != x.grad.dtype:
                x.grad = y.grad.to(x.dtype)  # the reference sees the values the bf16 gradients hold
        live = [p.grad for p in a if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_([p for p in a if p.grad is not None], max_norm) if max_norm \
            else torch.nn.utils.get_total_norm(live)
        reference.step()
        ours.step(max_norm=max_norm)
        assert float(ours.grad_norm) == pytest.approx(float(norm), rel=1e-5)
    return float(norm)


@kernels
@pytest.mark.parametrize("max_norm", [1.0, 0.0], ids=["clipped", "no_clip"])
def test_steps_equal_torch_adamw_after_clip_grad_norm(max_norm):
    """Three steps over two groups; in the second one parameter has no gradient, so it steps one time fewer and
    the third step launches once per step count, as torch's AdamW counts per parameter."""
    a, b = _pairs()
    reference = torch.optim.AdamW(_groups(a), weight_decay=0.01, fused=DEVICE.type == "cuda")
    ours = TritonAdamW(_groups(b), weight_decay=0.01)
    norm = _three_steps(reference, ours, a, b, max_norm)
    assert norm > 10 * max(max_norm, 1.0)  # the clip bit: the norm is far above its limit
    _assert_same(reference, ours, a, b)
    assert [float(ours.state[p]["step"]) for p in b] == [3, 2, 3, 3, 3]


@kernels
def test_the_clip_reaches_the_moments_and_skipping_it_would_show():
    """The first moment after one clipped step is (1 - beta1) x the clipped gradient: its norm is (1 - beta1) x the
    limit. An unclipped step (the control) is far from that, so the comparison above could fail."""
    a, b = _pairs(1)
    clipped, unclipped = TritonAdamW(a), TritonAdamW(b)
    _set_grads(a, b, 0)
    clipped.step(max_norm=1e-3)
    unclipped.step()
    moment = torch.nn.utils.get_total_norm([clipped.state[p]["exp_avg"] for p in a]).item()
    assert moment == pytest.approx(0.1 * 1e-3, rel=1e-4)
    control = torch.nn.utils.get_total_norm([unclipped.state[p]["exp_avg"] for p in b]).item()
    assert control > 100 * moment


@kernels
def test_state_moves_between_torch_adamw_and_the_kernels():
    """torch's AdamW state loaded into the kernels' optimizer (and back) continues as torch would; the loaded
    moments land in the flat buffers the kernels update, so the optimizer's state shows what they wrote."""
    a, b = _pairs(2)
    reference = torch.optim.AdamW(_groups(a))
    for step in range(2):
        _set_grads(a, b, step)
        torch.nn.utils.clip_grad_norm_(a, 1.0)
        reference.step()
    for x, y in zip(a, b, strict=True):
        y.data.copy_(x.data)
    ours = TritonAdamW(_groups(b))
    ours.load_state_dict(reference.state_dict())
    assert all(ours.state[p]["exp_avg"].data_ptr() == ours._moment(ours._exp_avg, p).data_ptr() for p in b)
    for step in (2, 3):
        _set_grads(a, b, step)
        torch.nn.utils.clip_grad_norm_(a, 1.0)
        reference.step()
        ours.step(max_norm=1.0)
    _assert_same(reference, ours, a, b)

    # and back: torch's AdamW from a copy of the kernels' state takes the step the kernels take
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in b]
    back = torch.optim.AdamW(_groups(back_params))
    back.load_state_dict(copy.deepcopy(ours.state_dict()))
    _set_grads(back_params, b, 4)
    torch.nn.utils.clip_grad_norm_(back_params, 1.0)
    back.step()
    ours.step(max_norm=1.0)
    _assert_same(back, ours, back_params, b)


def test_loading_a_state_without_a_parameter_starts_its_moments_at_zero():
    """torch's AdamW keeps no state for a parameter that never had a gradient; loading that leaves it unstepped."""
    a, b = _pairs(3)
    reference = torch.optim.AdamW(a)
    _set_grads(a, b, 0, skip=2)
    reference.step()
    ours = TritonAdamW(b)
    ours._exp_avg.fill_(1.0)
    ours.load_state_dict(reference.state_dict())
    assert float(ours.state[b[2]]["step"]) == 0 and not ours.state[b[2]]["exp_avg"].any()
    assert float(ours.state[b[0]]["step"]) == 1 and ours.state[b[0]]["exp_avg"].data_ptr() == ours._exp_avg.data_ptr()
    with pytest.raises(ValueError, match="build it with every parameter group"):
        ours.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


@kernels
def test_whole_float4_sizes_take_the_aligned_launch_with_the_same_result():
    """Sizes in fours at 16-byte addresses launch with ALIGNED (the compiler may read four values at once); the
    result is torch's as above. A size off the fours, or a gradient at an odd address, takes the plain launch."""
    from sd3cluster.fused_adamw import _Tables

    gen = torch.Generator().manual_seed(5)
    a = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in [(2 * CHUNK,), (96, 128), (4,)]]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    reference, ours = torch.optim.AdamW(a, fused=DEVICE.type == "cuda"), TritonAdamW(b)
    for step in range(2):
        _set_grads(a, b, step)
        torch.nn.utils.clip_grad_norm_(a, 1.0)
        reference.step()
        ours.step(max_norm=1.0)
    assert ours._table(b).aligned()
    _assert_same(reference, ours, a, b)

    # gradients as views of one buffer (as DDP's buckets hold them) 4 and 16 bytes past its start: plain launches
    for shift in (1, 4):
        flat = torch.zeros(sum(p.numel() for p in b) + shift, device=DEVICE)
        start = shift
        for x, y in zip(a, b, strict=True):
            y.grad = flat[start:start + y.numel()].view_as(y).copy_(torch.full_like(y, 0.5 * shift))
            x.grad = y.grad.clone()
            start += y.numel()
        torch.nn.utils.clip_grad_norm_(a, 1.0)
        reference.step()
        ours.step(max_norm=1.0)
        assert ours._table(b).aligned() is (shift == 4)
        _assert_same(reference, ours, a, b)

    odd = _Tables([torch.zeros(6), torch.zeros(4)], [0, 6], torch.device("cpu"))
    odd.pointers("grad", [torch.zeros(6), torch.zeros(4)])
    assert not odd.aligned()
    fours = _Tables([torch.zeros(8), torch.zeros(4)], [0, 8], torch.device("cpu"))
    fours.pointers("grad", [torch.zeros(8), torch.zeros(9)[1:5]])  # 4 bytes past an allocation's start
    assert not fours.aligned()
    fours.pointers("grad", [torch.zeros(8), torch.zeros(4)])
    assert fours.aligned()


@kernels
@pytest.mark.parametrize("max_norm", [1.0, 0.0], ids=["clipped", "no_clip"])
def test_bf16_weights_step_their_fp32_masters_as_torch_adamw_steps_fp32_weights(max_norm):
    """With masters the kernels read bf16 gradients, step the fp32 masters as torch's AdamW steps fp32 weights
    given the same (bf16-valued) gradients, and leave every weight exactly its master rounded to bf16."""
    a, b = _pairs(6)
    masters = bf16_weights_with_fp32_masters(b)
    assert all(p.dtype == torch.bfloat16 and masters[p].dtype == torch.float32 for p in b)
    assert all(torch.equal(masters[p], x.detach()) for p, x in zip(b, a, strict=True))  # the fp32 values kept
    reference = torch.optim.AdamW(_groups(a), weight_decay=0.01, fused=DEVICE.type == "cuda")
    ours = TritonAdamW(_groups(b), weight_decay=0.01, masters=masters)
    _three_steps(reference, ours, a, b, max_norm)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(masters[y], x.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(y.detach(), bf16_as_kernel_rounds(masters[y]))
        for key, atol in (("exp_avg", 1e-6), ("exp_avg_sq", 1e-5)):
            torch.testing.assert_close(ours.state[y][key], reference.state[x][key], rtol=1e-5, atol=atol)
    # the masters moved by more than bf16 keeps: the weights alone could not have carried these steps
    assert any(not torch.equal(masters[y], masters[y].to(torch.bfloat16).float()) for y in b)


@kernels
def test_bf16_weights_load_fp32_moments_without_rounding_them():
    """torch's loading casts a state to its parameter's dtype (bf16 here); the moments are copied as given."""
    a, b = _pairs(7)
    reference = torch.optim.AdamW(a)
    _set_grads(a, b, 0)
    reference.step()
    ours = TritonAdamW(b, masters=bf16_weights_with_fp32_masters(b))
    ours.load_state_dict(reference.state_dict())
    for x, y in zip(a, b, strict=True):
        assert ours.state[y]["exp_avg"].dtype == torch.float32
        assert torch.equal(ours.state[y]["exp_avg"], reference.state[x]["exp_avg"])
        assert torch.equal(ours.state[y]["exp_avg_sq"], reference.state[x]["exp_avg_sq"])
    assert not torch.equal(reference.state[a[3]]["exp_avg"].bfloat16().float(), reference.state[a[3]]["exp_avg"])


def test_masters_are_checked():
    fp32 = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    masters = bf16_weights_with_fp32_masters(fp32)
    assert kernel_problem(fp32, masters) is None
    assert "without an fp32 master" in kernel_problem([*fp32, torch.zeros(2, dtype=torch.bfloat16)], masters)
    assert "contiguous fp32" in kernel_problem(fp32[:1], {fp32[0]: torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="expected fp32"):
        bf16_weights_with_fp32_masters(fp32)  # already bf16
    with pytest.raises(UserError, match="without an fp32 master"):
        TritonAdamW(fp32, masters={fp32[0]: masters[fp32[0]]})


def test_resolve_weights_takes_bf16_only_where_masters_can_live():
    ok = dict(adamw_kernel="triton", bf16_compute=True, mode="full", float8="none", grad_accum=1)
    assert resolve_weights("auto", **ok)[0] == "bf16"
    assert resolve_weights("fp32", **ok) == ("fp32", "fp32 (asked for)")
    for change, words in ((dict(adamw_kernel="torch"), "optim.kernel resolved to torch"),
                          (dict(bf16_compute=False), "train.precision=bf16 on a GPU"),
                          (dict(mode="lora"), "train.mode=lora"),
                          (dict(float8="rowwise"), "model.float8=rowwise"),
                          (dict(grad_accum=4), "train.grad_accum=4")):
        kind, why = resolve_weights("auto", **{**ok, **change})
        assert kind == "fp32" and words in why, why
        with pytest.raises(UserError, match=re.escape(words) + ".*set train.weights=auto or fp32"):
            resolve_weights("bf16", **{**ok, **change})
    with pytest.raises(UserError, match=re.escape("train.weights='fp16'; choose one of auto, fp32, bf16")):
        resolve_weights("fp16", **ok)


def test_kernel_problem_names_what_the_kernels_cannot_step():
    assert kernel_problem([torch.zeros(3), torch.zeros(2, 2)]) is None
    assert "bfloat16" in kernel_problem([torch.zeros(3, dtype=torch.bfloat16)])
    assert "contiguous" in kernel_problem([torch.zeros(4, 4).t()])
    assert kernel_problem([]) == "no parameters to train"


def test_resolve_adamw_kernel_choices_and_errors():
    cpu, cuda, params = torch.device("cpu"), torch.device("cuda"), [torch.zeros(3)]
    assert resolve_adamw_kernel("torch", "adamw", True, cuda, params) == ("torch", "torch (asked for)")
    assert resolve_adamw_kernel("auto", "adamw", True, cpu, params) == ("torch", "torch (auto: not a CUDA device)")
    kind, why = resolve_adamw_kernel("auto", "adamw8bit", True, cuda, params)
    assert kind == "torch" and "adamw8bit" in why
    kind, why = resolve_adamw_kernel("auto", "adamw", False, cuda, params)
    assert kind == "torch" and "optim.fused=false" in why
    with pytest.raises(UserError, match=re.escape("optim.kernel=triton cannot run here (not a CUDA device); "
                                                  "set optim.kernel=auto or torch")):
        resolve_adamw_kernel("triton", "adamw", True, cpu, params)
    with pytest.raises(UserError, match=re.escape("optim.kernel='fast'; choose one of auto, torch, triton")):
        resolve_adamw_kernel("fast", "adamw", True, cpu, params)
    if importlib.util.find_spec("triton") is not None:
        assert resolve_adamw_kernel("auto", "adamw", True, cuda, params)[0] == "triton"
        kind, why = resolve_adamw_kernel("auto", "adamw", True, cuda, [torch.zeros(3, dtype=torch.bfloat16)])
        assert kind == "torch" and "bfloat16" in why


def test_optim_kernel_is_a_checked_config_key(tmp_path: Path):
    with pytest.raises(UserError, match=r"optim\.kernel"):
        load_config(None, ["optim.kernel=fastest"])


def _trainer(tmp_path: Path, kernel: str):
    """A tiny CPU Trainer whose AdamW is torch's fused one or the Triton kernels (the CPU resolves auto to torch's
    unfused AdamW, so both are put in place here); a tiny clip limit makes the clip bite."""
    from sd3cluster.train import Trainer

    cfg = load_config(None, [TINY[i + 1] for i in range(0, len(TINY), 2)] + [
        "data.synthetic_samples=8", "optim.grad_clip=1e-3", f"output.dir={tmp_path}/out"])
    trainer = Trainer(cfg, local_runtime(torch.device("cpu")))
    kwargs = dict(lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    trainer.optimizer = TritonAdamW(trainer.params, **kwargs) if kernel == "triton" else \
        torch.optim.AdamW(trainer.params, fused=True, **kwargs)
    trainer.scheduler = make_warmup(trainer.optimizer, cfg.optim.warmup_steps)
    return trainer


@kernels
def test_trainer_steps_with_the_kernels_as_with_torch_and_checkpoints_move_between_them(tmp_path: Path):
    from sd3cluster.checkpoint import CheckpointManager

    if DEVICE.type != "cpu":
        pytest.skip("the tiny Trainer runs on the CPU here")
    runs = {kernel: _trainer(tmp_path / kernel, kernel) for kernel in ("torch", "triton")}
    metrics = {kernel: [t.train_step() for _ in range(2)] for kernel, t in runs.items()}
    for got, expected in zip(metrics["triton"], metrics["torch"], strict=True):
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert metrics["torch"][0]["grad_norm"] > 100 * 1e-3  # far above the limit: the clip changed the step
    torch.testing.assert_close(runs["triton"].flat_parameters(), runs["torch"].flat_parameters(), rtol=1e-5,
                               atol=1e-7)

    # The kernels' checkpoint resumed by torch's AdamW takes the step the kernels take.
    manager = CheckpointManager(tmp_path / "ck", local_runtime(torch.device("cpu")))
    runs["triton"].save(manager)
    resumed = _trainer(tmp_path / "resumed", "torch")
    resumed.load(manager, manager.latest())
    assert resumed.step == 2
    assert resumed.optimizer.param_groups[0]["fused"] is True  # the checkpoint's fused=None is not taken over
    assert resumed.train_step()["loss"] == pytest.approx(runs["triton"].train_step()["loss"], rel=1e-5)
    torch.testing.assert_close(resumed.flat_parameters(), runs["triton"].flat_parameters(), rtol=1e-5, atol=1e-7)
    for t in (*runs.values(), resumed):
        t.close()
