"""train.weights=bf16 through the Trainer and DDP: bf16 weights and gradients, fp32 masters in the Triton AdamW.

The CPU resolves train.weights (and optim.kernel) to fp32 (torch), so the Trainer tests force the two choices and
compute with the CPU's bf16 autocast; the kernels run under Triton's interpreter (conftest.py). DDP's hook for bf16
gradients runs on two gloo processes.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sd3_helpers import TINY, bf16_as_kernel_rounds
from sd3cluster import train as train_module
from sd3cluster.checkpoint import CheckpointManager
from sd3cluster.config import load_config
from sd3cluster.dist import Runtime, local_runtime
from sd3cluster.errors import UserError
from sd3cluster.parallel import apply_ddp, unwrap

CPU = torch.device("cpu")
kernels = pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                             reason="needs Triton's interpreter (Triton installed, no GPU)")


def _config(tmp_path: Path, *extra: str):
    return load_config(None, [TINY[i + 1] for i in range(0, len(TINY), 2)] + [
        "data.synthetic_samples=8", "optim.grad_clip=1e-3", f"output.dir={tmp_path}/out", *extra])


def _trainer(tmp_path: Path, weights: str, monkeypatch, *extra: str):
    """A tiny CPU Trainer with bf16 weights (the two choices forced, bf16 autocast) or fp32 ones (torch's AdamW)."""
    if weights == "bf16":
        monkeypatch.setattr(train_module, "resolve_adamw_kernel", lambda *a, **k: ("triton", "triton (forced)"))
        monkeypatch.setattr(train_module, "resolve_weights", lambda *a, **k: ("bf16", "bf16 (forced)"))
    else:  # an fp32 run after a forced one in the same test: the real choices again
        monkeypatch.undo()
    trainer = train_module.Trainer(_config(tmp_path, *extra), local_runtime(CPU))
    trainer.bf16 = weights == "bf16"  # the CPU's autocast, which the CPU never turns on by itself
    return trainer


@kernels
def test_bf16_weights_train_and_checkpoint_their_fp32_masters(tmp_path: Path, monkeypatch):
    run = _trainer(tmp_path / "a", "bf16", monkeypatch, "train.ema_decay=0.9")
    assert run.params and all(p.dtype == torch.bfloat16 and run.masters[p].dtype == torch.float32 for p in run.params)
    assert "weights: bf16 (forced)" in run.kernel_note
    assert all(a is run.masters[p] for a, p in zip(run.ema.params, run.params, strict=True))  # EMA of the masters
    metrics = [run.train_step() for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert metrics[0]["grad_norm"] > 100 * 1e-3  # the clip bit
    for p in run.params:
        assert p.grad is None
        assert torch.equal(p.detach(), bf16_as_kernel_rounds(run.masters[p]))
    # the masters moved by less than bf16 can show: the weights alone would not have kept these steps
    assert any(not torch.equal(run.masters[p], p.detach().float()) for p in run.params)

    # a resume restores the masters exactly (not their bf16 weights) and takes the step the run takes
    manager = CheckpointManager(tmp_path / "ck", local_runtime(CPU))
    run.save(manager)
    saved_masters = run.flat_parameters()
    saved_weights = torch.cat([p.detach().float().flatten() for p in unwrap(run.model).parameters()])
    assert not torch.equal(saved_masters, saved_weights)  # so the fp32 resume below can tell which was saved
    resumed = _trainer(tmp_path / "b", "bf16", monkeypatch, "train.ema_decay=0.9")
    resumed.load(manager, manager.latest())
    assert resumed.step == 2
    with torch.no_grad():  # the weights a GPU's kernel writes: Triton's interpreter truncates, torch's loading rounds
        for p in run.params:
            p.copy_(run.masters[p])
    assert torch.equal(resumed.flat_parameters(), run.flat_parameters())
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(resumed.params, run.params, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, run.ema.shadow, strict=True))
    assert resumed.train_step()["loss"] == run.train_step()["loss"]
    assert torch.equal(resumed.flat_parameters(), run.flat_parameters())

    # an fp32 run (torch's AdamW) resumes the same checkpoint with the masters as its weights
    fp32 = _trainer(tmp_path / "c", "fp32", monkeypatch)
    fp32.load(CheckpointManager(tmp_path / "ck", local_runtime(CPU)), manager.latest())
    assert fp32.masters is None and all(p.dtype == torch.float32 for p in fp32.params)
    assert fp32.step == 2 and torch.equal(fp32.flat_parameters(), saved_masters)
    for t in (run, resumed, fp32):
        t.close()


@kernels
def test_an_fp32_checkpoint_resumes_with_bf16_weights(tmp_path: Path, monkeypatch):
    fp32 = _trainer(tmp_path / "a", "fp32", monkeypatch)
    fp32.train_step()
    manager = CheckpointManager(tmp_path / "ck", local_runtime(CPU))
    fp32.save(manager)
    run = _trainer(tmp_path / "b", "bf16", monkeypatch)
    run.load(manager, manager.latest())
    assert torch.equal(run.flat_parameters(), fp32.flat_parameters())  # the fp32 weights became the masters
    assert all(torch.equal(p.detach(), fp32_p.detach().to(torch.bfloat16))  # rounded by torch on loading
               for p, fp32_p in zip(run.params, fp32.params, strict=True))
    for key in ("exp_avg", "exp_avg_sq"):  # fp32 moments kept whole, not rounded to the weights' bf16
        assert all(torch.equal(run.optimizer.state[p][key], fp32.optimizer.state[q][key])
                   for p, q in zip(run.params, fp32.params, strict=True))
    for t in (run, fp32):
        t.close()


def test_train_weights_is_a_checked_config_key_and_bf16_stops_where_it_cannot_run(tmp_path: Path):
    with pytest.raises(UserError, match=r"train\.weights"):
        load_config(None, ["train.weights=fp16"])
    trainer = train_module.Trainer(_config(tmp_path, "train.weights=auto"), local_runtime(CPU))  # the CPU: fp32
    assert trainer.masters is None and trainer.weights == "fp32"
    assert "weights: fp32 (auto: bf16 weights need bf16 compute" in trainer.kernel_note
    trainer.close()
    with pytest.raises(UserError, match=r"train\.weights=bf16 cannot run here .*set train\.weights=auto or fp32"):
        train_module.Trainer(_config(tmp_path, "train.weights=bf16"), local_runtime(CPU))


def _ddp_rank(rank: int, world: int, store_path: str, ordered: bool, results: dict) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
    local = torch.nn.Linear(64, 48).to(torch.bfloat16)
    local.load_state_dict(model.state_dict())
    local(x).float().square().sum().backward()  # this rank's own gradient, in bf16
    ddp = apply_ddp(model, Runtime(rank, world, rank, CPU, True), ordered_reduce=ordered)
    ddp(x).float().square().sum().backward()
    parts = [torch.empty(local.weight.numel() + local.bias.numel(), dtype=torch.bfloat16) for _ in range(world)]
    dist.all_gather(parts, torch.cat([local.weight.grad.flatten(), local.bias.grad.flatten()]))
    results[rank] = (torch.cat([model.weight.grad.flatten(), model.bias.grad.flatten()]), parts)
    dist.destroy_process_group()


@pytest.mark.parametrize("ordered", [False, True], ids=["all_reduce", "ordered"])
def test_ddp_averages_bf16_gradients_in_fp32(tmp_path: Path, ordered: bool):
    """DDP's mean of bf16 gradients is the fp32 mean of the ranks' bf16 gradients, rounded once to bf16."""
    world = 3
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ddp_rank, args=(world, str(tmp_path / "store"), ordered, results), nprocs=world)
        results = dict(results)
    parts = results[0][1]
    if ordered:  # summed in rank order, then divided
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        expected = (total / world).to(torch.bfloat16)
    else:  # each part divided by the world first, as DDP's own all-reduce does
        expected = sum(part.float() / world for part in parts).to(torch.bfloat16)
    for rank in range(world):
        assert results[rank][0].dtype == torch.bfloat16
        differ = float((results[rank][0] != expected).float().mean())
        # the ring adds the fp32 parts in its own order: a last-bit difference may round the other way, rarely
        assert differ == 0 if ordered else differ < 0.01, differ
    assert not torch.equal(parts[0], parts[1])  # the ranks' gradients differ, so the mean is a real one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path: CUDA autocast, the compiled kernels")
def test_on_a_gpu_auto_takes_bf16_weights_and_trains_as_fp32_weights_do(tmp_path: Path):
    """On CUDA auto resolves to the Triton AdamW with bf16 weights; the losses follow an fp32-weight run's (both
    compute in bf16, so only the weights' rounding differs) and every weight is its master rounded to nearest."""
    runs = {}
    for weights in ("auto", "fp32"):
        cfg = _config(tmp_path / weights, "train.precision=bf16", "train.device=cuda", "model.compile=false",
                      "optim.grad_clip=1.0", f"train.weights={weights}")
        trainer = train_module.Trainer(cfg, local_runtime(torch.device("cuda")))
        start = trainer.flat_parameters()
        runs[weights] = (trainer, [trainer.train_step()["loss"] for _ in range(4)], start)
    bf16, fp32 = runs["auto"][0], runs["fp32"][0]
    assert (bf16.weights, bf16.adamw_kernel, fp32.weights) == ("bf16", "triton", "fp32")
    assert all(p.dtype == torch.bfloat16 and torch.equal(p.detach(), bf16.masters[p].to(torch.bfloat16))
               for p in bf16.params)
    assert runs["auto"][1] == pytest.approx(runs["fp32"][1], rel=2e-2)
    assert runs["auto"][1][-1] != runs["auto"][1][0]  # it trained
    assert torch.equal(runs["auto"][2], runs["fp32"][2])  # the same start (the masters are the fp32 init)
    moved = (fp32.flat_parameters() - runs["fp32"][2]).abs().mean()
    assert (bf16.flat_parameters() - fp32.flat_parameters()).abs().mean() < 0.25 * moved
    for trainer, *_ in runs.values():
        trainer.close()
