"""What each rank's Trainer reads, checked on one process by giving it another rank's view."""

from pathlib import Path

import torch
from sd3_helpers import TINY
from sd3cluster.config import load_config
from sd3cluster.dist import Runtime
from sd3cluster.train import Trainer


def _trainer(tmp_path: Path, rank: int, fixed_batch: bool) -> Trainer:
    cfg = load_config(None, [TINY[i + 1] for i in range(0, len(TINY), 2)] + [
        "data.synthetic_samples=16", "data.batch_size=2", f"output.dir={tmp_path}/out"])
    # Not distributed: nothing is reduced, so each view computes its own rank's loss.
    return Trainer(cfg, Runtime(rank, 2, 0, torch.device("cpu"), False), fixed_batch=fixed_batch)


def test_ranks_read_different_samples_in_training(tmp_path: Path):
    assert _trainer(tmp_path, 0, False).sampler.next_indices() != _trainer(tmp_path, 1, False).sampler.next_indices()


def test_fixed_batch_is_the_same_batch_and_loss_on_every_rank(tmp_path: Path):
    """The overfit check's curve must not depend on the cluster's size: every rank memorises one batch."""
    first, second = _trainer(tmp_path, 0, True), _trainer(tmp_path, 1, True)
    assert first.data_batch == second.data_batch == 2
    losses = [[t.train_step()["loss"] for _ in range(3)] for t in (first, second)]
    assert losses[0] == losses[1]
    assert first.sampler.next_indices() == second.sampler.next_indices()
