import json
import shutil
from pathlib import Path

import pytest
import torch
from sd3_helpers import TINY, sd3cluster
from sd3cluster.checkpoint import CheckpointManager, complete_checkpoints
from sd3cluster.config import load_config
from sd3cluster.dist import local_runtime
from sd3cluster.errors import CheckpointError
from sd3cluster.train import Trainer

RT = local_runtime(torch.device("cpu"))


def _cfg(tmp_path: Path, steps: int = 4):
    return load_config(None, [TINY[i + 1] for i in range(0, len(TINY), 2)] + [
        "data.synthetic_samples=16", f"train.steps={steps}", "train.ema_decay=0.9", f"output.dir={tmp_path}/out"])


def test_save_load_restores_everything(tmp_path: Path):
    manager = CheckpointManager(tmp_path / "ck", RT, keep=2)
    a = Trainer(_cfg(tmp_path), RT)
    for _ in range(3):
        a.train_step()
    a.save(manager)
    b = Trainer(_cfg(tmp_path), RT)
    b.load(manager, manager.latest())
    assert b.step == 3 and b.sampler.state_dict() == a.sampler.state_dict()
    assert torch.equal(a.flat_parameters(), b.flat_parameters())
    assert all(torch.equal(x, y) for x, y in zip(a.ema.shadow, b.ema.shadow, strict=True))
    assert [a.train_step()["loss"] for _ in range(2)] == [b.train_step()["loss"] for _ in range(2)]


def test_keep_last_k_and_latest_pointer(tmp_path: Path):
    manager = CheckpointManager(tmp_path / "ck", RT, keep=2)
    t = Trainer(_cfg(tmp_path), RT)
    for _ in range(4):
        t.train_step()
        t.save(manager)
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")] == [3, 4]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-00000004"


def test_checkpoint_cut_off_mid_write_is_never_chosen(tmp_path: Path):
    ck = tmp_path / "ck"
    manager = CheckpointManager(ck, RT, keep=3)
    t = Trainer(_cfg(tmp_path), RT)
    t.train_step()
    good = t.save(manager)
    # A save that died before its marker: the temporary folder, and a copy that lost its COMPLETE file.
    shutil.copytree(good, ck / ".tmp-step-00000009")
    shutil.copytree(good, ck / "step-00000008")
    (ck / "step-00000008" / "COMPLETE").unlink()
    partial = next((ck / "step-00000008").glob("*.distcp"))
    partial.write_bytes(partial.read_bytes()[:10])
    assert manager.latest() == good
    with pytest.raises(CheckpointError, match="incomplete"):
        manager.load(ck / "step-00000008", t.tensor_state())


def test_unreadable_checkpoint_is_a_clear_error(tmp_path: Path):
    ck = tmp_path / "ck"
    result = sd3cluster("train", "--device", "cpu", "--steps", "2", *TINY, "--set", "data.synthetic_samples=8",
                        "--checkpoint-dir", str(ck), "--set", f"output.dir={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr
    for f in (ck / "step-00000002").glob("*.distcp"):
        f.write_bytes(b"\0garbage")
    json.loads((ck / "step-00000002" / "COMPLETE").read_text())
    result = sd3cluster("train", "--device", "cpu", "--steps", "4", *TINY, "--set", "data.synthetic_samples=8",
                        "--checkpoint-dir", str(ck), "--set", f"output.dir={tmp_path / 'out'}")
    assert result.returncode == 2
    assert "step-00000002 cannot be read" in result.stderr and "checkpoint.resume=never" in result.stderr
    assert "Traceback" not in result.stderr
