import json
from pathlib import Path

from sd3_helpers import TINY, sd3cluster
from sd3cluster.data import ShardDataset


def test_prepare_images_then_train_on_them(tiny_encoders: Path, image_folder: Path, tmp_path: Path):
    out = tmp_path / "shards"
    result = sd3cluster("prepare", "--images", str(image_folder), "--encoders", str(tiny_encoders), "--out", str(out),
                        "--resolution", "32", "--set", "prepare.clip_tokens=6", "--set", "prepare.t5_tokens=5",
                        "--set", "prepare.shard_size=3", "--set", "prepare.device=cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    ds = ShardDataset(out)
    assert len(ds) == 4 and len(ds.shards) == 2
    assert ds.shapes == {"latents": (16, 4, 4), "prompt_embeds": (11, 32), "pooled": (16,)}
    index = json.loads((out / "index.json").read_text())
    assert (index["vae_scaling"], index["vae_shift"]) == (1.5305, 0.0609)

    run = tmp_path / "run"
    result = sd3cluster("train", "--device", "cpu", "--data", str(out), "--steps", "3", "--batch-size", "2", *TINY,
                        "--set", f"output.dir={run}")
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["images_per_s"] > 0 for r in records)
    assert any((run / "tensorboard").iterdir())


def test_prepare_names_the_image_without_caption(tiny_encoders: Path, image_folder: Path, tmp_path: Path):
    (image_folder / "img1.txt").unlink()
    result = sd3cluster("prepare", "--images", str(image_folder), "--encoders", str(tiny_encoders),
                        "--out", str(tmp_path / "o"), "--resolution", "32")
    assert result.returncode == 2 and "img1.png has no caption" in result.stderr


def test_prepare_synthetic(tmp_path: Path):
    result = sd3cluster("prepare", "--synthetic", "6", "--out", str(tmp_path / "s"), "--resolution", "32",
                        "--set", "data.text_tokens=8")
    assert result.returncode == 0, result.stderr
    assert len(ShardDataset(tmp_path / "s")) == 6
