"""Memory-lean training switches: gradient accumulation, 8-bit optimizer state, no text encoders in training."""

from pathlib import Path

import pytest
import torch
from sd3_helpers import TINY
from sd3cluster.checkpoint import CheckpointManager
from sd3cluster.config import load_config
from sd3cluster.data import write_synthetic_shards
from sd3cluster.dist import local_runtime
from sd3cluster.errors import UserError
from sd3cluster.train import Trainer, train

RT = local_runtime(torch.device("cpu"))
TINY_SETS = [TINY[i + 1] for i in range(0, len(TINY), 2)]


def _cfg(tmp_path: Path, *sets: str):
    return load_config(None, [*TINY_SETS, "data.synthetic_samples=16", f"output.dir={tmp_path}/out",
                              "optim.lr=1e-3", *sets])


def test_k_micro_batches_equal_one_k_times_batch(tmp_path: Path):
    runs = {}
    for batch, accum in ((4, 1), (2, 2), (1, 4)):
        trainer = Trainer(_cfg(tmp_path, f"data.batch_size={batch}", f"train.grad_accum={accum}"), RT)
        losses = [trainer.train_step()["loss"] for _ in range(5)]  # crosses an epoch (4 steps of 4 samples)
        runs[accum] = (losses, trainer.flat_parameters())
    one_losses, one_params = runs[1]
    for accum in (2, 4):
        losses, params = runs[accum]
        # The same samples, noise and timesteps; only the order of the sums differs (fp32). AdamW divides by
        # sqrt(v), which magnifies that rounding where a gradient is tiny: 1e-5 is 1% of one step's move at
        # lr 1e-3, while one wrong sample or noise moves parameters by about 1e-3.
        assert max(abs(a - b) for a, b in zip(losses, one_losses, strict=True)) < 1e-6, (accum, losses, one_losses)
        assert (params - one_params).abs().max() < 1e-5, accum


def test_training_never_loads_text_encoders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Precomputed embeddings: the training loop reads shards; T5-XXL and the CLIPs are never built."""
    import transformers

    def refuse(*_, **__):
        raise AssertionError("a text encoder was built during training")

    for cls in (transformers.T5EncoderModel, transformers.CLIPTextModelWithProjection):
        monkeypatch.setattr(cls, "__init__", refuse)
    monkeypatch.setattr("sd3cluster.components.load_encoders", refuse)
    write_synthetic_shards(tmp_path / "shards", 8, (16, 4, 4), 8, 32, 16)
    cfg = load_config(None, [*TINY_SETS, f"data.path={tmp_path / 'shards'}", "train.steps=2",
                             f"output.dir={tmp_path}/out", "output.progress=false"])
    assert train(cfg, RT)["step"] == 2


def test_torchao_8bit_adamw_keeps_8bit_state_and_resumes_exactly(tmp_path: Path):
    pytest.importorskip("torchao")
    cfg = _cfg(tmp_path, "optim.optimizer=ao_adamw8bit")
    manager = CheckpointManager(tmp_path / "ck", RT)
    a = Trainer(cfg, RT)
    for _ in range(2):
        a.train_step()
    states = [s for state in a.optimizer.state.values() for s in state.values()]
    # Like bitsandbytes, torchao keeps tensors under 4096 values (the tiny model's small ones) in fp32.
    assert any(type(s).__name__ == "OptimState8bit" for s in states)
    path = a.save(manager)
    b = Trainer(cfg, RT)
    b.load(manager, path)
    assert [a.train_step()["loss"] for _ in range(2)] == [b.train_step()["loss"] for _ in range(2)]
    assert torch.equal(a.flat_parameters(), b.flat_parameters())


def test_bitsandbytes_optimizers_say_they_need_cuda(tmp_path: Path):
    with pytest.raises(UserError, match="bitsandbytes', which runs on CUDA devices only"):
        Trainer(_cfg(tmp_path, "optim.optimizer=paged_adamw8bit"), RT)
