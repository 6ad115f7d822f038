"""LoRA (train.mode=lora): only adapters train and are saved, resume is exact, the exported file is diffusers'
format (StableDiffusion3Pipeline.load_lora_weights computes what the trained module did), wrong inputs are refused."""

from pathlib import Path

import pytest
import torch
from sd3_helpers import TINY, sd3cluster
from sd3cluster.checkpoint import CheckpointManager
from sd3cluster.config import ConfigError, ExportConfig, load_config
from sd3cluster.dist import local_runtime
from sd3cluster.errors import CheckpointError, UserError
from sd3cluster.export import export
from sd3cluster.lora import LORA_FILE
from sd3cluster.models import build_transformer, example_inputs
from sd3cluster.parallel import unwrap
from sd3cluster.train import Trainer

RT = local_runtime(torch.device("cpu"))
TINY_SETS = [TINY[i + 1] for i in range(0, len(TINY), 2)]


def _cfg(tmp_path: Path, *sets: str):
    return load_config(None, [*TINY_SETS, "data.synthetic_samples=16", f"output.dir={tmp_path}/out",
                              "train.mode=lora", "lora.rank=4", "optim.lr=1e-2", *sets])


def test_only_adapters_train_and_the_loss_falls(tmp_path: Path):
    trainer = Trainer(_cfg(tmp_path, "data.synthetic_samples=2", "optim.lr=3e-2"), RT, fixed_batch=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    losses = [trainer.train_step()["loss"] for _ in range(15)]
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n in before if ".lora_A." in n or ".lora_B." in n}
    assert changed == adapters and len(adapters) == 26  # 13 adapted linears of the tiny model's 2 blocks, A and B
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} == adapters
    # A rank-4 adapter of a random tiny model has little room: 0.77 of the first loss after 15 steps.
    assert losses[-1] < 0.85 * losses[0], losses


def test_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    cfg = _cfg(tmp_path, "train.ema_decay=0.9", "lora.group_lr={ff: 3e-3}")
    manager = CheckpointManager(tmp_path / "ck", RT)
    a = Trainer(cfg, RT)
    assert sorted(g["lr"] for g in a.optimizer.param_groups) == [3e-3, 1e-2]
    for _ in range(3):
        a.train_step()
    path = a.save(manager)
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k or k == "model.pos_embed.pos_embed" for k in model_keys)
    b = Trainer(cfg, RT)
    b.load(manager, path)
    assert [a.train_step()["loss"] for _ in range(3)] == [b.train_step()["loss"] for _ in range(3)]
    assert torch.equal(a.flat_parameters(), b.flat_parameters())
    assert all(torch.equal(x, y) for x, y in zip(a.ema.shadow, b.ema.shadow, strict=True))


def _diffusers_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from sd3cluster.components import random_encoders

    enc = random_encoders("tiny")
    return StableDiffusion3Pipeline(
        transformer=build_transformer("tiny"), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=enc.vae,
        text_encoder=enc.clip_l, tokenizer=enc.tok_l, text_encoder_2=enc.clip_g, tokenizer_2=enc.tok_g,
        text_encoder_3=enc.t5, tokenizer_3=enc.tok_t5)


@pytest.mark.parametrize("sets", [
    ["lora.alpha=8"],  # fused q/k/v: one adapter per fused layer, exported as three that share A
    ["model.fuse_qkv=false", "lora.alpha=2", "lora.target_modules=[attn.to_q, attn.to_v, ff.net.2, norm1.linear]"],
], ids=["fused", "unfused-subset"])
def test_exported_lora_loads_into_diffusers_and_computes_what_training_did(tmp_path: Path, sets: list[str]):
    from sd3cluster.pipeline import load_pipeline

    trainer = Trainer(_cfg(tmp_path, *sets), RT)
    for _ in range(4):
        trainer.train_step()
    trainer.save(CheckpointManager(tmp_path / "ck", RT))
    out = export(ExportConfig(checkpoint=tmp_path / "ck", out=tmp_path / "lora", dtype="fp32"))
    assert (out / LORA_FILE).is_file()

    inputs = example_inputs("tiny", 2, 32, 8, "cpu")
    with torch.no_grad():
        trained = unwrap(trainer.model).eval()(**inputs, return_dict=False)[0]
        pipe = _diffusers_pipeline()
        base = pipe.transformer(**inputs, return_dict=False)[0]
        pipe.load_lora_weights(out)
        theirs = pipe.transformer(**inputs, return_dict=False)[0]
        ours = load_pipeline("tiny", torch.device("cpu"), torch.float32, lora=out, log=lambda _: None)
        merged = ours.transformer(**inputs, return_dict=False)[0]
    assert (trained - base).abs().max() > 1e-3  # the adapters changed the output...
    torch.testing.assert_close(theirs, trained, atol=1e-5, rtol=1e-4)  # ...and diffusers' loader reproduces it
    torch.testing.assert_close(merged, trained, atol=1e-5, rtol=1e-4)  # so does generate/serve's merge


def test_full_checkpoint_is_refused_where_adapters_are_expected(tmp_path: Path):
    full = Trainer(load_config(None, [*TINY_SETS, "data.synthetic_samples=16", f"output.dir={tmp_path}/out"]), RT)
    full.train_step()
    manager = CheckpointManager(tmp_path / "full", RT)
    path = full.save(manager)
    with pytest.raises(CheckpointError, match=r"holds a full model .* not LoRA adapters"):
        Trainer(_cfg(tmp_path), RT).load(manager, path)
    lora = Trainer(_cfg(tmp_path), RT)
    lora.train_step()
    lora_path = lora.save(CheckpointManager(tmp_path / "lora", RT))
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters .* not a full model"):
        full.load(manager, lora_path)
    with pytest.raises(CheckpointError, match=r"other adapters .*rank: checkpoint 4, config 8"):
        Trainer(_cfg(tmp_path, "lora.rank=8"), RT).load(manager, lora_path)
    # A full model given where a LoRA file is expected (generate/serve --lora), and a LoRA given as a model.
    export(ExportConfig(checkpoint=tmp_path / "full", out=tmp_path / "full-x", dtype="fp32"))
    from sd3cluster.lora import read_lora

    with pytest.raises(UserError, match="is a full model folder, not a LoRA"):
        read_lora(tmp_path / "full-x")
    weights = next((tmp_path / "full-x" / "transformer").glob("*.safetensors"))
    with pytest.raises(UserError, match="holds no LoRA tensors"):
        read_lora(weights)
    from sd3cluster.export import load_trained_transformer

    with pytest.raises(CheckpointError, match="holds LoRA adapters, not a transformer"):
        load_trained_transformer(lora_path)


def test_cli_lora_resume_of_a_full_run_is_one_clear_line(tmp_path: Path):
    ck = tmp_path / "ck"
    common = ["train", "--device", "cpu", *TINY, "--set", "data.synthetic_samples=8", "--checkpoint-dir", str(ck),
              "--set", f"output.dir={tmp_path / 'out'}", "--set", "output.progress=false"]
    assert sd3cluster(*common, "--steps", "1").returncode == 0
    result = sd3cluster(*common, "--steps", "2", "--mode", "lora")
    assert result.returncode == 2, result.stderr
    assert "holds a full model (train.mode=full), not LoRA adapters" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("sets, message", [
    (["lora.target_modules=[attn.to_x]"], "unknown target module(s) attn.to_x"),
    (["lora.target_modules=[ff.net.2]", "lora.group_lr={attn: 1e-3}"], "group_lr key 'attn' matches none"),
    (["lora.target_modules=[attn.to_q, attn.to_k]"], "name all three, or set model.fuse_qkv=false"),
    (["train.parallel=fsdp"], "train.mode=lora runs with train.parallel=ddp"),
    (["lora.rank=0"], "lora.rank"),
    (["optim.optimizer=adam9bit"], "optim.optimizer"),
])
def test_bad_lora_config_is_one_line(tmp_path: Path, sets: list[str], message: str):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, *sets)
    assert message in str(err.value) and "\n" not in str(err.value)
