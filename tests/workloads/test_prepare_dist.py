"""`prepare` over several ranks: 2 gloo ranks under torchrun write the same dataset, byte for byte, as one process;
a run whose rank is SIGKILLed mid-way resumes (here on another rank count) to that same dataset, skipping the
shards it had finished and never reading the killed writers' temporary files; bad input stops with one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from sd3_helpers import sd3cluster, torchrun
from sd3cluster.data import ShardDataset

# (width, height) of the images made in code: five aspect-ratio buckets at 64^2 pixels with step 16
# (see test_buckets.py), 2 to 3 images in some, so shards of 2 give 6 shards of 1 and 2 samples.
SIZES = [(64, 64), (70, 66), (128, 64), (200, 90), (240, 80), (60, 120), (30, 120), (90, 60), (66, 99)]


def _images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(1)
    for i, (w, h) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a photo of a red cat {i}\n")
    return folder


def _args(images: Path, encoders: Path, out: Path, *extra: str) -> list[str]:
    return ["prepare", "--images", str(images), "--encoders", str(encoders), "--out", str(out), "--resolution", "64",
            "--set", "prepare.buckets=true", "--set", "prepare.bucket_step=16", "--set", "prepare.clip_tokens=6",
            "--set", "prepare.t5_tokens=5", "--set", "prepare.device=cpu", "--set", "prepare.shard_size=2",
            "--set", "prepare.batch_size=1", *extra]


def _dataset_files(out: Path) -> dict[str, bytes]:
    """Every file a reader of the dataset opens: index.json and the shards it lists."""
    index = json.loads((out / "index.json").read_text())
    return {"index.json": (out / "index.json").read_bytes(),
            **{s["file"]: (out / s["file"]).read_bytes() for s in index["shards"]}}


def _one_error_line(stderr: str) -> bool:
    """The CLI's one-line error and no traceback (libraries may print their own import warnings around it)."""
    return "Traceback" not in stderr and sum(line.startswith("sd3cluster prepare: error:")
                                             for line in stderr.splitlines()) == 1


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return _images(tmp_path_factory.mktemp("mixed") / "images")


@pytest.fixture(scope="module")
def one_rank(images: Path, tiny_encoders: Path, tmp_path_factory) -> Path:
    """The reference: one process, no torchrun."""
    out = tmp_path_factory.mktemp("one") / "shards"
    result = sd3cluster(*_args(images, tiny_encoders, out))
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_two_ranks_write_the_dataset_one_process_writes(one_rank: Path, images: Path, tiny_encoders: Path,
                                                       tmp_path: Path):
    out = tmp_path / "shards"
    result = torchrun(2, *_args(images, tiny_encoders, out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 shard(s) of <= 2 in 5 bucket(s)" in result.stdout and "2 rank(s)" in result.stdout
    assert "shards made per rank: 3 3)" in result.stdout  # both ranks encoded, each its half
    assert _dataset_files(out) == _dataset_files(one_rank)

    ds = ShardDataset(out)
    assert len(ds) == len(SIZES) and len(ds.shards) == 6
    originals = []
    for shard in ds.shards:
        with safe_open(str(out / shard["file"]), "pt") as f:
            originals += [tuple(s) for s in f.get_tensor("original_size").tolist()]
            # The VAE noise is drawn per sample: two samples of one shard never share a latent.
            latents = f.get_tensor("latents")
            assert all(not latents[0].equal(latents[i]) for i in range(1, len(latents)))
    assert sorted(originals) == sorted(SIZES)  # every image once


def test_a_killed_run_resumes_to_the_same_dataset(one_rank: Path, images: Path, tiny_encoders: Path, tmp_path: Path):
    out = tmp_path / "shards"
    # Rank 1 owns shards 1, 3 and 5; it dies hard after its first, and torchrun stops rank 0 wherever it is.
    killed = torchrun(2, *_args(images, tiny_encoders, out, "--set", "prepare.kill_after_shards=1",
                                "--set", "prepare.kill_rank=1"))
    assert killed.returncode != 0
    assert "fault injection: SIGKILL after 1 shard(s)" in killed.stdout + killed.stderr
    assert not (out / "index.json").exists()  # a killed run is not a dataset
    finished = {p.name: p.stat() for p in out.glob("shard-*.safetensors")}
    assert "shard-00001.safetensors" in finished and "shard-00003.safetensors" not in finished
    # What a writer killed mid-write leaves: the first bytes of a shard under the writer's temporary name.
    partial = out / ".shard-00005.safetensors.999999.tmp"
    partial.write_bytes((one_rank / "shard-00005.safetensors").read_bytes()[:100])

    resumed = sd3cluster(*_args(images, tiny_encoders, out))  # one rank finishes what two started
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"; {len(finished)} shard(s) (" in resumed.stdout
    # Ours, and any rank 0 left when torchrun stopped it in the middle of a write.
    removed = re.search(r"removed (\d+) unfinished temporary", resumed.stdout)
    assert removed and int(removed.group(1)) >= 1, resumed.stdout
    assert f"shards made per rank: {6 - len(finished)})" in resumed.stdout
    for name, before in finished.items():  # finished shards were skipped, not written again
        after = (out / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name
    assert not list(out.glob(".*.tmp"))
    assert _dataset_files(out) == _dataset_files(one_rank)
    assert len(ShardDataset(out)) == len(SIZES)


def test_rerun_with_other_settings_is_refused_in_one_line(one_rank: Path, images: Path, tiny_encoders: Path):
    before = _dataset_files(one_rank)
    result = sd3cluster(*_args(images, tiny_encoders, one_rank, "--set", "prepare.shard_size=3"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "holds shards made from other images or settings (shard_size: 2 before, 3 now)" in result.stderr
    assert _one_error_line(result.stderr)
    assert _dataset_files(one_rank) == before


def test_unreadable_image_is_named_in_one_line(images: Path, tiny_encoders: Path, tmp_path: Path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in images.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "img3.png").write_bytes(b"not a png")
    result = sd3cluster(*_args(broken, tiny_encoders, tmp_path / "out"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "img3.png cannot be read" in result.stderr and _one_error_line(result.stderr)
    assert not (tmp_path / "out").exists()  # stopped before anything was written
