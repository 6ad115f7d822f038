import threading
from pathlib import Path

import pytest
import torch
from sd3_helpers import TINY, sd3cluster
from sd3cluster.data import DistributedBatchSampler, ReadAhead, ShardDataset, write_synthetic_shards
from sd3cluster.errors import DataError


def test_sampler_partitions_the_global_batch():
    ranks = [DistributedBatchSampler(20, 6, r, 3, seed=1) for r in range(3)]
    single = DistributedBatchSampler(20, 6, 0, 1, seed=1)
    for _ in range(7):  # crosses an epoch boundary (3 batches per epoch)
        joined = [i for s in ranks for i in s.next_indices()]
        assert joined == single.next_indices()
        assert len(set(joined)) == 6


def test_sampler_resumes_exactly():
    a = DistributedBatchSampler(50, 4, 1, 2, seed=7)
    for _ in range(13):
        a.next_indices()
    b = DistributedBatchSampler(50, 4, 1, 2, seed=7)
    b.load_state_dict(a.state_dict())
    assert [a.next_indices() for _ in range(20)] == [b.next_indices() for _ in range(20)]


def test_sampler_peek_is_the_next_batch_across_epochs():
    s = DistributedBatchSampler(10, 4, rank=1, world=2, seed=5)  # 2 batches per epoch: peeks cross epochs
    for _ in range(7):
        state = s.state_dict()
        peeked = s.peek_indices()
        assert s.state_dict() == state  # peeking does not move the sampler
        assert s.next_indices() == peeked


def test_read_ahead_loads_the_next_key_on_its_thread():
    threads: dict[int, str] = {}

    def load(key: int) -> int:
        threads[key] = threading.current_thread().name
        return key * 10

    reader = ReadAhead(load)
    assert reader.take(1, next_key=2) == 10
    assert reader.ahead is not None and reader.ahead[0] == 2
    reader.ahead[1].result()  # key 2 was loaded before anyone asked for it
    assert set(threads) == {1, 2}
    assert reader.take(2, next_key=3) == 20 and threads[2].startswith("sd3cluster-data")
    assert reader.take(7) == 70  # not the key read ahead (a resume moved the sampler): loaded on the spot
    assert reader.ahead is None
    reader.close()


def test_read_ahead_raises_a_failed_read_where_it_is_taken():
    def load(key: int) -> int:
        if key == 2:
            raise DataError("shard 2 is unreadable")
        return key

    reader = ReadAhead(load)
    assert reader.take(1, next_key=2) == 1  # the failing read ahead does not fail this step
    with pytest.raises(DataError, match="shard 2 is unreadable"):
        reader.take(2)
    reader.close()


def test_shards_round_trip(tmp_path: Path):
    write_synthetic_shards(tmp_path / "d", 10, (16, 4, 4), 8, 32, 16, shard_size=4)
    ds = ShardDataset(tmp_path / "d")
    assert len(ds) == 10 and len(ds.shards) == 3
    batch = ds.get([0, 5, 9])
    assert batch.latents.shape == (3, 16, 4, 4) and batch.prompt_embeds.shape == (3, 8, 32)
    assert batch.pooled.shape == (3, 16) and torch.isfinite(batch.latents).all()


def test_missing_and_incomplete_data(tmp_path: Path):
    with pytest.raises(DataError, match="does not exist"):
        ShardDataset(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    with pytest.raises(DataError, match=r"index\.json"):
        ShardDataset(tmp_path / "half")
    with pytest.raises(DataError, match="fewer than one global batch"):
        DistributedBatchSampler(3, 4, 0, 1)


def test_cli_missing_data_is_a_clear_error(tmp_path: Path):
    result = sd3cluster("train", "--device", "cpu", "--data", str(tmp_path / "absent"), *TINY,
                        "--set", f"output.dir={tmp_path / 'out'}")
    assert result.returncode == 2, result.stderr
    assert "data.path" in result.stderr and "sd3cluster prepare" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_data_that_does_not_fit_the_model(tmp_path: Path):
    write_synthetic_shards(tmp_path / "d", 8, (16, 4, 4), 8, 64, 16)
    result = sd3cluster("train", "--device", "cpu", "--data", str(tmp_path / "d"), *TINY,
                        "--set", f"output.dir={tmp_path / 'out'}")
    assert result.returncode == 2 and "model.preset=tiny reads 32" in result.stderr


def test_damaged_shards_are_named_when_the_dataset_opens(tmp_path: Path):
    """Caught at open (before a run writes anything), naming the shard file rather than safetensors' words."""
    import json

    write_synthetic_shards(tmp_path / "d", 8, (16, 4, 4), 8, 32, 16, shard_size=4)
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    index["shards"][1]["samples"] = 5  # the index claims more than the file holds
    (tmp_path / "d" / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"shard .*shard-00001\.safetensors is damaged \(it holds fewer samples"):
        ShardDataset(tmp_path / "d")
    (tmp_path / "d" / "shard-00000.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(DataError, match=r"shard-00000\.safetensors is damaged .*sd3cluster prepare"):
        ShardDataset(tmp_path / "d")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(DataError, match="is a file, not a folder"):
        ShardDataset(tmp_path / "a_file")
