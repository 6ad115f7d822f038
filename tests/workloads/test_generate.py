"""generate: the same images whatever the rank count, resumable after a killed rank, CFG parallel, clear errors;
and the pipeline against diffusers' own StableDiffusion3Pipeline."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from sd3_helpers import run_env, sd3cluster, torchrun

PROMPTS = ["a photo of a red cat", "a big blue house", "a small green tree in the sky", "a dog on a house",
           "a city at night", "a river under the sun", "a white car"]
# 32x32 images (4x4 latents) with the tiny random pipeline: a few milliseconds an image.
FAST = ["--size", "32", "--steps", "3", "--batch-size", "2", "--guidance", "5"]


def _prompts(tmp_path: Path, lines: list[str] = PROMPTS, name: str = "prompts.txt") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _images(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "images").glob("*.png"))}


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img).astype(np.int16)


def _manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def test_same_image_bytes_on_1_2_and_3_ranks(tmp_path: Path):
    prompts = _prompts(tmp_path)
    runs = {}
    for nproc in (1, 2, 3):
        out = tmp_path / f"r{nproc}"
        result = torchrun(nproc, "generate", "--prompts", str(prompts), "--out", str(out), *FAST,
                          "--images-per-prompt", "2")
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        runs[nproc] = _images(out)
        manifest = _manifest(out)
        assert [m["file"] for m in manifest] == [f"images/{i:06d}-{k:03d}.png" for i in range(7) for k in range(2)]
        assert len({m["seed"] for m in manifest}) == 14  # a seed of its own for every (prompt, image)
        assert manifest[3]["prompt"] == PROMPTS[1] and manifest[3]["steps"] == 3
        assert json.loads((out / "progress.json").read_text())["done"] == 14
    assert len(runs[1]) == 14
    assert runs[1] == runs[2] == runs[3]
    assert len(set(runs[1].values())) == 14  # every image differs from the others


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_killed_rank_then_rerun_completes_the_set_once(tmp_path: Path):
    prompts = _prompts(tmp_path, [f"a photo of a cat {i}" for i in range(10)])
    slow = ["--size", "32", "--steps", "300", "--batch-size", "1", "--guidance", "5"]
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=0", "-m", "sd3cluster", "generate",
           "--prompts", str(prompts), "--out", str(out), *slow]
    launcher = subprocess.Popen(cmd, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while len(list((out / "images").glob("*.png"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(list((out / "images").glob("*.png"))) >= 2, "no image appeared in time"
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGKILL)  # the rank started second
        assert launcher.wait(timeout=120) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    partial = _images(out)
    assert 2 <= len(partial) < 10, len(partial)
    result = torchrun(2, "generate", "--prompts", str(prompts), "--out", str(out), *slow)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"{len(partial)} already done" in result.stdout or "already done" in result.stdout
    done = _images(out)
    assert sorted(done) == [f"{i:06d}-000.png" for i in range(10)]
    assert all(done[name] == data for name, data in partial.items())  # nothing written twice
    assert not list((out / "images").glob(".*")), "a temporary file was left behind"
    manifest = _manifest(out)
    assert [m["file"] for m in manifest] == [f"images/{i:06d}-000.png" for i in range(10)]
    for name in done:  # every PNG decodes whole
        assert _pixels(out / "images" / name).shape == (32, 32, 3)
    # The resumed set is the set an uninterrupted run makes.
    reference = tmp_path / "reference"
    result = sd3cluster("generate", "--prompts", str(prompts), "--out", str(reference), *slow)
    assert result.returncode == 0, result.stderr
    assert _images(reference) == done


def test_cfg_parallel_equals_the_plain_run(tmp_path: Path):
    prompts = _prompts(tmp_path)
    plain, split = tmp_path / "plain", tmp_path / "split"
    assert sd3cluster("generate", "--prompts", str(prompts), "--out", str(plain), *FAST).returncode == 0
    result = torchrun(2, "generate", "--prompts", str(prompts), "--out", str(split), *FAST, "--cfg-parallel")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert sorted(_images(split)) == sorted(_images(plain))
    # Both runs compute the same two predictions per step, batched together (2B) or one per rank (B); a GEMM's
    # rounding may depend on its row count, so the latents can differ in the last float bits. That can move a
    # pixel across a rounding boundary by one level of 255, never more.
    for name in _images(plain):
        diff = np.abs(_pixels(plain / "images" / name) - _pixels(split / "images" / name))
        assert diff.max() <= 1, (name, diff.max())


def test_rerun_with_other_settings_is_refused(tmp_path: Path):
    prompts = _prompts(tmp_path)
    out = tmp_path / "out"
    assert sd3cluster("generate", "--prompts", str(prompts), "--out", str(out), *FAST).returncode == 0
    before = _images(out)
    result = sd3cluster("generate", "--prompts", str(prompts), "--out", str(out), *FAST[:-2], "--guidance", "3")
    assert result.returncode == 2 and "guidance: 5.0 before, 3.0 now" in result.stderr
    assert _images(out) == before
    result = sd3cluster("generate", "--prompts", str(prompts), "--out", str(out), *FAST)
    assert result.returncode == 0 and "7 already done" in result.stdout


@pytest.mark.parametrize("case, extra, message", [
    ("missing", [], "does not exist"),
    ("empty", [], "holds no prompts"),
    ("not_object", [], "prompts.jsonl:2: a JSON list, not an object"),
    ("bad_width", [], "prompts.jsonl:1: \"width\" 40 must be a multiple of 16"),
    ("ok", ["--steps", "0"], "generate.steps: Input should be greater than or equal to 1"),
    ("ok", ["--size", "40"], "width must be a multiple of 16"),
    ("ok", ["--checkpoint", "/nonexistent/ck"], "checkpoint /nonexistent/ck does not exist"),
    ("ok", ["--pretrained", "/nonexistent/sd3"], "--pretrained /nonexistent/sd3 does not exist"),
    ("ok", ["--cfg-parallel"], "--cfg-parallel pairs the ranks, but there are 1"),
])
def test_bad_input_is_one_clear_line_and_writes_nothing(tmp_path: Path, case: str, extra: list[str], message: str):
    files = {"missing": None, "empty": "\n\n", "not_object": '{"prompt": "a cat"}\n["a dog"]\n',
             "bad_width": '{"prompt": "a cat", "width": 40}\n', "ok": '{"prompt": "a cat"}\n'}
    path = tmp_path / "prompts.jsonl"
    if files[case] is not None:
        path.write_text(files[case])
    out = tmp_path / "out"
    result = sd3cluster("generate", "--prompts", str(path), "--out", str(out), "--size", "32", "--steps", "2", *extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


def test_pipeline_equals_diffusers_stable_diffusion3_pipeline():
    """The same random components through diffusers' pipeline and ours: the same pixels (fp32, CPU), up to the
    rounding of the fused q/k/v projection."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from sd3cluster.components import random_encoders
    from sd3cluster.models import build_transformer
    from sd3cluster.pipeline import SD3Pipeline

    enc = random_encoders("tiny")
    theirs = StableDiffusion3Pipeline(
        transformer=build_transformer("tiny"), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=enc.vae,
        text_encoder=enc.clip_l, tokenizer=enc.tok_l, text_encoder_2=enc.clip_g, tokenizer_2=enc.tok_g,
        text_encoder_3=enc.t5, tokenizer_3=enc.tok_t5)
    theirs.set_progress_bar_config(disable=True)
    ours = SD3Pipeline(build_transformer("tiny"), random_encoders("tiny"), torch.device("cpu"), torch.float32)
    for seed, guidance, negative in ((5, 7.0, ""), (9, 1.0, ""), (11, 4.0, "a dog")):
        expected = theirs("a red cat", negative_prompt=negative, height=32, width=48, num_inference_steps=4,
                          guidance_scale=guidance, max_sequence_length=77, output_type="np",
                          generator=[torch.Generator().manual_seed(seed)]).images
        images, times = ours(["a red cat"], [seed], 32, 48, 4, guidance, [negative])
        assert images.shape == (1, 32, 48, 3) and times.denoise > 0
        # Ours computes q, k and v with one fused GEMM where diffusers runs three: the same sums in another
        # order, so a pixel may land one level of 255 apart; an error in the pipeline moves many by far more.
        diff = np.abs((expected * 255).round().astype(np.int16) - images.astype(np.int16))
        assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (seed, guidance, diff.max(), (diff > 0).mean())


def test_training_previews_equal_generate_from_the_same_checkpoint(tmp_path: Path):
    """train's previews (2 ranks, rank-sharded) are the images `generate` makes from that step's checkpoint."""
    prompts = ["a photo of a red cat", "a big blue house", "a small green tree"]
    ck, run = tmp_path / "ck", tmp_path / "run"
    result = torchrun(2, "train", "--device", "cpu", "--steps", "4", "--batch-size", "1", "--set", "data.resolution=32",
                      "--set", "data.text_tokens=8", "--set", "train.precision=fp32", "--set",
                      "data.synthetic_samples=16", "--set", f"checkpoint.dir={ck}", "--set", "checkpoint.every=2",
                      "--set", f"output.dir={run}", "--set", "output.progress=false", "--set", "preview.every=2",
                      "--set", f"preview.prompts={json.dumps(prompts)}", "--set", "preview.steps=3",
                      "--set", "preview.guidance=5", "--set", "preview.seed=3")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for step in (2, 4):
        assert sorted(p.name for p in (run / "previews" / f"step-{step:08d}").iterdir()) == ["000.png", "001.png",
                                                                                               "002.png"]
    out = tmp_path / "gen"
    result = sd3cluster("generate", "--prompts", str(_prompts(tmp_path, prompts)), "--out", str(out),
                        "--checkpoint", str(ck), "--step", "2", "--size", "32", "--steps", "3", "--guidance", "5",
                        "--seed", "3")
    assert result.returncode == 0, result.stderr
    for i in range(3):
        assert np.array_equal(_pixels(run / "previews" / "step-00000002" / f"{i:03d}.png"),
                              _pixels(out / "images" / f"{i:06d}-000.png")), i
    assert not np.array_equal(_pixels(run / "previews" / "step-00000002" / "000.png"),
                              _pixels(run / "previews" / "step-00000004" / "000.png"))  # the weights moved
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={IMAGES: 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["preview/000", "preview/001", "preview/002"]
    assert [e.step for e in events.Images("preview/001")] == [2, 4]
