"""Aspect-ratio buckets: the documented bucket set, prepare sorting mixed sizes into it, and a sampler whose every
micro-batch holds one bucket, partitioned over ranks and resumable."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sd3_helpers import TINY, sd3cluster
from sd3cluster.buckets import BucketBatchSampler, bucket_set, cover_and_crop, nearest_bucket
from sd3cluster.config import load_config
from sd3cluster.data import ShardDataset
from sd3cluster.dist import local_runtime
from sd3cluster.train import Trainer

# (width, height) of the images made in code -> the bucket each must land in (resolution 64, step 16).
SIZES = {(64, 64): (64, 64), (70, 66): (64, 64), (128, 64): (80, 48), (200, 90): (80, 48), (240, 80): (96, 32),
         (60, 120): (48, 80),
         (30, 120): (32, 128), (90, 60): (80, 48), (66, 99): (48, 80)}


def test_the_documented_bucket_set():
    buckets = bucket_set(1024)
    assert len(buckets) == 25 and buckets[0] == (512, 2048) and buckets[-1] == (2048, 512)
    assert (1024, 1024) in buckets and (1152, 896) in buckets and (896, 1152) in buckets
    assert all(w * h <= 1024 * 1024 and w % 64 == 0 and h % 64 == 0 for w, h in buckets)
    assert all(max(w / h, h / w) <= 4 for w, h in buckets)
    assert nearest_bucket(1920, 1080, buckets) == (1344, 768)
    assert cover_and_crop(1920, 1080, (1344, 768)) == ((1365, 768), (10, 0))


def _mixed_images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a photo of a red cat {i}\n")
    return folder


def test_prepare_sorts_mixed_sizes_into_buckets_and_training_reads_one_shape_per_batch(tiny_encoders: Path,
                                                                                          tmp_path: Path):
    out = tmp_path / "shards"
    result = sd3cluster("prepare", "--images", str(_mixed_images(tmp_path / "images")), "--encoders",
                        str(tiny_encoders), "--out", str(out), "--resolution", "64", "--set", "prepare.buckets=true",
                        "--set", "prepare.bucket_step=16", "--set", "prepare.clip_tokens=6",
                        "--set", "prepare.t5_tokens=5", "--set", "prepare.device=cpu", "--set", "prepare.batch_size=2")
    assert result.returncode == 0, result.stdout + result.stderr
    index = json.loads((out / "index.json").read_text())
    assert index["buckets"] == [[32, 128], [48, 80], [64, 64], [80, 48], [96, 32]]
    assert len(ShardDataset(out)) == len(SIZES)
    from safetensors import safe_open

    found = {}
    for shard in index["shards"]:
        with safe_open(str(out / shard["file"]), "pt") as f:
            latents = f.get_tensor("latents")
            assert tuple(latents.shape[2:]) == (shard["bucket"][1] // 8, shard["bucket"][0] // 8)
            for size, crop in zip(f.get_tensor("original_size").tolist(), f.get_tensor("crop").tolist(), strict=True):
                found[tuple(size)] = (tuple(shard["bucket"]), tuple(crop))
    assert {size: bucket for size, (bucket, _) in found.items()} == SIZES
    assert found[(200, 90)][1] == cover_and_crop(200, 90, (80, 48))[1] == (13, 0)

    cfg = load_config(None, [TINY[i + 1] for i in range(0, len(TINY), 2)] + [
        f"data.path={out}", "data.batch_size=1", f"output.dir={tmp_path}/run"])
    trainer = Trainer(cfg, local_runtime(torch.device("cpu")))
    assert isinstance(trainer.sampler, BucketBatchSampler)
    for _ in range(10):  # crosses an epoch (8 batches of 1)
        assert trainer.train_step()["loss"] > 0


def test_bucket_sampler_one_bucket_per_batch_partitioned_and_resumable():
    buckets = [i % 3 for i in range(40)] + [3] * 2  # bucket 3 is smaller than a global batch: never drawn
    ranks = [BucketBatchSampler(buckets, 4, r, 2, seed=3) for r in range(2)]
    single = BucketBatchSampler(buckets, 4, 0, 1, seed=3)
    assert single.batches_per_epoch == 9  # buckets of 14, 13 and 13 samples: 3 global batches of 4 each
    seen = []
    for _ in range(2 * single.batches_per_epoch + 1):
        joined = [i for s in ranks for i in s.next_indices()]
        assert joined == single.next_indices()
        assert len({buckets[i] for i in joined}) == 1 and len(set(joined)) == 4
        seen.append(joined)
    first_epoch = [i for b in seen[:single.batches_per_epoch] for i in b]
    assert len(set(first_epoch)) == len(first_epoch)  # no sample twice in an epoch
    resumed = BucketBatchSampler(buckets, 4, 1, 2, seed=3)
    resumed.load_state_dict(ranks[1].state_dict())
    assert [resumed.next_indices() for _ in range(12)] == [ranks[1].next_indices() for _ in range(12)]


def test_bad_bucket_step_is_one_line(tmp_path: Path):
    result = sd3cluster("prepare", "--synthetic", "2", "--out", str(tmp_path / "s"), "--set", "prepare.bucket_step=24")
    assert result.returncode == 2 and "bucket_step must be a multiple of 16" in result.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("resolution, step", [(32, 64)])
def test_no_bucket_fits_is_a_clear_error(resolution: int, step: int):
    from sd3cluster.errors import DataError

    with pytest.raises(DataError, match="no bucket"):
        bucket_set(resolution, step)
