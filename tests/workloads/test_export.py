"""export: a training checkpoint becomes a diffusers folder that loads and computes what the trained module did."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from sd3_helpers import TINY, sd3cluster, torchrun
from sd3cluster.checkpoint import CheckpointManager
from sd3cluster.config import load_config
from sd3cluster.dist import local_runtime
from sd3cluster.models import example_inputs, fuse_qkv, unfuse_state_dict
from sd3cluster.parallel import unwrap
from sd3cluster.train import Trainer

RT = local_runtime(torch.device("cpu"))
TINY_SETS = [TINY[i + 1] for i in range(0, len(TINY), 2)]


def _trained(tmp_path: Path, steps: int = 3) -> tuple[Trainer, Path]:
    cfg = load_config(None, [*TINY_SETS, "data.synthetic_samples=16", "train.ema_decay=0.9",
                             f"output.dir={tmp_path}/out"])
    trainer = Trainer(cfg, RT)
    for _ in range(steps):
        trainer.train_step()
    manager = CheckpointManager(tmp_path / "ck", RT)
    return trainer, trainer.save(manager)


def _load_exported(folder: Path):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32).eval()


def test_export_round_trip_is_bitwise(tmp_path: Path):
    trainer, _ = _trained(tmp_path)
    result = sd3cluster("export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "x"), "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    assert "wrote the transformer folder" in result.stdout
    exported = _load_exported(tmp_path / "x")
    trained = unwrap(trainer.model).eval()
    # The same tensors under diffusers' own names (the trained module fused q/k/v)...
    expected = unfuse_state_dict(trained.state_dict())
    got = exported.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in got)
    # ...and, fused the same way, the same outputs bit for bit.
    fuse_qkv(exported)
    inputs = example_inputs("tiny", 2, 32, 8, "cpu")
    with torch.no_grad():
        assert torch.equal(trained(**inputs, return_dict=False)[0], exported(**inputs, return_dict=False)[0])
    provenance = json.loads((tmp_path / "x" / "sd3cluster-export.json").read_text())
    assert provenance["step"] == 3 and provenance["dtype"] == "fp32" and provenance["base"] is None


def test_export_ema_and_bf16(tmp_path: Path):
    trainer, step_dir = _trained(tmp_path)
    result = sd3cluster("export", "--checkpoint", str(step_dir), "--out", str(tmp_path / "ema"), "--ema",
                        "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    exported = dict(unwrap(_load_exported(tmp_path / "ema")).named_parameters())
    fused = dict(zip([n for n, p in unwrap(trainer.model).named_parameters() if p.requires_grad],
                     trainer.ema.shadow, strict=True))
    assert all(torch.equal(v, exported[k]) for k, v in unfuse_state_dict(fused).items())
    result = sd3cluster("export", "--checkpoint", str(step_dir), "--out", str(tmp_path / "bf16"))
    assert result.returncode == 0, result.stderr
    from safetensors import safe_open

    with safe_open(next((tmp_path / "bf16" / "transformer").glob("*.safetensors")), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_export_with_base_is_a_whole_pipeline(tmp_path: Path, tiny_encoders: Path):
    from diffusers import StableDiffusion3Pipeline

    _trained(tmp_path)
    result = sd3cluster("export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "pipe"),
                        "--base", str(tiny_encoders), "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    assert pipe.transformer.config.num_layers == 2 and pipe.scheduler.config.shift == 3.0


def _ranks_checkpoint(tmp_path: Path, name: str, nproc: int, parallel: str) -> Path:
    ck = tmp_path / name
    result = torchrun(nproc, "train", "--device", "cpu", "--steps", "3", "--batch-size", str(4 // nproc), *TINY,
                      "--set", "data.synthetic_samples=16", "--set", f"train.parallel={parallel}",
                      "--set", f"checkpoint.dir={ck}", "--set", f"output.dir={tmp_path}/{name}-out",
                      "--set", "output.progress=false", "--set", "optim.lr=1e-3")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    out = tmp_path / f"{name}-x"
    result = sd3cluster("export", "--checkpoint", str(ck), "--out", str(out), "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    return out


def test_export_of_ddp_and_fsdp_ranks_equals_one_process(tmp_path: Path):
    one = _load_exported(_ranks_checkpoint(tmp_path, "one", 1, "ddp")).state_dict()
    # The global batch is the same (4), so the weights agree up to the order of the gradient sums (fp32 rounding,
    # about 1e-7 a step; 1e-5 leaves room for 3 AdamW steps at lr 1e-3 and nothing more).
    for name, nproc, parallel in (("ddp2", 2, "ddp"), ("fsdp2", 2, "fsdp")):
        other = _load_exported(_ranks_checkpoint(tmp_path, name, nproc, parallel)).state_dict()
        assert other.keys() == one.keys()
        worst = max((one[k] - other[k]).abs().max().item() for k in one)
        assert worst < 1e-5, (name, worst)


def test_torn_checkpoint_is_refused_and_nothing_is_written(tmp_path: Path):
    _, step_dir = _trained(tmp_path)
    torn = tmp_path / "torn"
    shutil.copytree(step_dir, torn)
    (torn / "COMPLETE").unlink()
    result = sd3cluster("export", "--checkpoint", str(torn), "--out", str(tmp_path / "never"))
    assert result.returncode == 2 and "incomplete" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "never").exists()
    (step_dir / "COMPLETE").unlink()  # the run folder now holds no complete checkpoint either
    result = sd3cluster("export", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "never"))
    assert result.returncode == 2 and "holds no complete checkpoint" in result.stderr
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never*"))


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "/nonexistent/ck", "--out", "OUT"], "does not exist"),
    (["--checkpoint", "CK", "--out", "OUT", "--step", "7"], "no complete checkpoint of step 7; complete ones: 3"),
    (["--checkpoint", "CK", "--out", "FILE"], "is a file"),
    (["--checkpoint", "CK", "--out", "OUT", "--ema", "--set", "export.dtype=fp8"], "export.dtype"),
])
def test_export_bad_input_is_one_clear_line(tmp_path: Path, args: list[str], message: str):
    _trained(tmp_path)
    (tmp_path / "file").write_text("x")
    subs = {"OUT": str(tmp_path / "out"), "CK": str(tmp_path / "ck"), "FILE": str(tmp_path / "file")}
    result = sd3cluster("export", *[subs.get(a, a) for a in args])
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()
