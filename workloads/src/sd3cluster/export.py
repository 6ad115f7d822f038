"""`sd3cluster export`: a complete training checkpoint (DCP, DDP or FSDP2, any rank count) -> a diffusers folder.

The checkpoint's trainer.json describes the trained module (diffusers config, fused q/k/v or not); export rebuilds
it in one process, reads the model (or EMA) tensors from the DCP files (DCP reshards whatever the saving ranks
held), turns fused projections back into diffusers' names and writes `transformer/` with `save_pretrained`.
Everything is written into a hidden sibling folder first and renamed at the end, so a failed export leaves
nothing that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .checkpoint import MARKER, complete_checkpoints, is_complete, missing_parts
from .checks import writable_folder
from .config import ExportConfig
from .errors import CheckpointError, UserError
from .models import build_from_description, unfuse_state_dict
from .pipeline import DTYPES

# Parts of a diffusers SD3 pipeline folder besides the transformer (what --base contributes).
PIPELINE_PARTS = ("scheduler", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
                  "tokenizer_3")
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def resolve_checkpoint(path: Path, step: int | str = "latest") -> Path:
    """A step folder, or a run's checkpoint folder and the step to take from it (newest complete by default)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass the run's checkpoint.dir or one step-* in it")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a file; pass the run's checkpoint folder (checkpoint.dir)")
    if (path / ".metadata").is_file() or (path / MARKER).is_file():
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete: it has no {', '.join(missing_parts(path))} (its "
                                  "save was cut off); pick another step")
        return path
    done = complete_checkpoints(path)
    if not done:
        torn = sorted(p.name for p in path.glob("*step-*"))
        extra = f" ({', '.join(torn)} are incomplete: their saves were cut off)" if torn else ""
        raise CheckpointError(f"{path} holds no complete checkpoint{extra}; point at a run's checkpoint.dir")
    if step == "latest":
        return done[-1][1]
    for found_step, folder in done:
        if found_step == int(step):
            return folder
    raise CheckpointError(f"{path} has no complete checkpoint of step {step}; complete ones: "
                          f"{', '.join(str(s) for s, _ in done)}")


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((Path(path) / "trainer.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: trainer.json cannot be read ({e})") from None
    if "model" not in state:
        raise CheckpointError(f"checkpoint {path} does not describe its model (written by an older sd3cluster); "
                              "resume it once with this version and let it save again, then export that checkpoint")
    return state


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: its .metadata cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from None
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}


def _compare(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], path: Path, what: str) -> None:
    missing = [k for k in expected if k not in found]
    wrong = [f"{k} {found[k]} != {expected[k]}" for k in expected if k in found and found[k] != expected[k]]
    if missing or wrong:
        shown = (missing[:3] + wrong[:3])
        raise CheckpointError(f"checkpoint {path}: its {what} does not match the model its trainer.json describes "
                              f"({len(missing)} missing, {len(wrong)} of another shape; e.g. {'; '.join(shown)})")


def _load_dcp(template: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(template, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300]}); pick another step") from None


def load_adapters(path: Path, ema: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA checkpoint's adapter tensors (trained names, fp32) and its trainer state."""
    state = read_trainer_state(path)
    if state.get("mode", "full") != "lora":
        raise CheckpointError(f"checkpoint {path} holds a full model, not LoRA adapters; export it without LoRA "
                              "options (it becomes a transformer folder)")
    names = state["lora"]["parameters"]
    found = _checkpoint_shapes(path)
    adapters = {n: torch.empty(found.get(f"model.{n}", (0,)), dtype=torch.float32) for n in names}
    _compare({f"model.{n}": tuple(found.get(f"model.{n}", ())) or (-1,) for n in names}, found, path, "adapter state")
    if ema:
        if not state.get("ema"):
            raise CheckpointError(f"checkpoint {path} has no EMA weights (the run had train.ema_decay=0); "
                                  "export without --ema")
        shadow = {f"ema.{i}": t for i, t in enumerate(adapters.values())}
        _load_dcp({"ema": shadow}, path)
    else:
        _load_dcp({"model": adapters}, path)
    return adapters, state


def export_lora(cfg: ExportConfig, path: Path, out: Path) -> Path:
    """A LoRA checkpoint -> `out/pytorch_lora_weights.safetensors`, diffusers' format."""
    from safetensors.torch import save_file

    from .lora import LORA_FILE, to_diffusers

    if cfg.base is not None:
        raise UserError("export.base is for full checkpoints; a LoRA is applied to its base when generating "
                        "(--pretrained BASE --lora OUT)")
    start = time.perf_counter()
    adapters, state = load_adapters(path, ema=cfg.ema)
    lora = state["lora"]
    tensors = {k: v.to(DTYPES[cfg.dtype]) for k, v in to_diffusers(adapters, lora["rank"], lora["alpha"]).items()}
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_file(tensors, str(staging / LORA_FILE), metadata={"format": "pt"})
        provenance = {"checkpoint": str(path.resolve()), "step": state["step"], "ema": cfg.ema, "dtype": cfg.dtype,
                      "preset": state["model"].get("preset"), "kind": "lora", "rank": lora["rank"],
                      "alpha": lora["alpha"], "alpha_folded_into_lora_B": True,
                      "target_modules": lora["target_modules"], "pretrained": state.get("pretrained"),
                      "time": time.time()}
        (staging / "sd3cluster-export.json").write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked before
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"[export] wrote the LoRA {out / LORA_FILE} ({len(tensors) // 2} adapters, rank {lora['rank']}, "
          f"{cfg.dtype}, step {state['step']}) in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def load_trained_transformer(path: Path, ema: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The checkpoint's transformer as diffusers' SD3Transformer2DModel (unfused, fp32, on the CPU)."""
    state = read_trainer_state(path)
    if state.get("mode", "full") == "lora":
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters, not a transformer; export it "
                              "(`sd3cluster export`) and pass --pretrained BASE --lora EXPORTED")
    description = state["model"]
    # The module as trained (fused names, parameter order), on the meta device: nothing is initialised twice.
    trained = build_from_description(description, device="meta")
    found = _checkpoint_shapes(path)
    model_state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in trained.state_dict().items()}
    if ema:
        if not state.get("ema"):
            raise CheckpointError(f"checkpoint {path} has no EMA weights (the run had train.ema_decay=0); "
                                  "export without --ema")
        names = [n for n, p in trained.named_parameters() if p.requires_grad]
        shadow = {f"ema.{i}": torch.empty(model_state[n].shape, dtype=torch.float32) for i, n in enumerate(names)}
        _compare({f"ema.{k}": tuple(v.shape) for k, v in shadow.items()}, found, path, "EMA state")
        _load_dcp({"ema": shadow}, path)
        # Buffers (the positional table) are not averaged; they come from the model state.
        _load_dcp({"model": {k: v for k, v in model_state.items() if k not in names}}, path)
        for i, name in enumerate(names):
            model_state[name] = shadow[f"ema.{i}"]
    else:
        _compare({f"model.{k}": tuple(v.shape) for k, v in model_state.items()}, found, path, "model state")
        _load_dcp({"model": model_state}, path)
    model = build_from_description({**description, "fuse_qkv": False}, device="meta")
    model.load_state_dict(unfuse_state_dict(model_state), strict=True, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"checkpoint {path}: {', '.join(left[:3])} not found in it")
    return model.eval().requires_grad_(False), state


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        kind = "a file" if not out.is_dir() else "a folder that is not empty"
        raise UserError(f"export.out {out} is {kind}; name a new folder (export never overwrites)")
    writable_folder(out, "export.out (--out)")


def _copy_base(base: Path, dest: Path, link: bool) -> list[str]:
    missing = [p for p in PIPELINE_PARTS if p != "scheduler" and not (base / p).is_dir()]
    if missing:
        raise UserError(f"export.base {base} lacks {', '.join(missing)}: it must be a diffusers SD3 folder "
                        "(vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/)")
    copied = []
    for part in PIPELINE_PARTS:
        src = base / part
        if not src.is_dir():
            continue
        if link:
            os.symlink(src.resolve(), dest / part, target_is_directory=True)
        else:
            shutil.copytree(src, dest / part)
        copied.append(part)
    if "scheduler" not in copied:
        (dest / "scheduler").mkdir()
        (dest / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2))
    return copied


def _part_class(folder: Path, part: str) -> list[str]:
    """[library, class] of one part as its own config files name it (model_index.json's form)."""
    def read(name: str) -> dict[str, Any]:
        path = folder / part / name
        return json.loads(path.read_text()) if path.is_file() else {}

    if part.startswith("tokenizer"):
        return ["transformers", read("tokenizer_config.json").get("tokenizer_class", "AutoTokenizer")]
    if part.startswith("text_encoder"):
        return ["transformers", (read("config.json").get("architectures") or ["AutoModel"])[0]]
    if part == "scheduler":
        return ["diffusers", read("scheduler_config.json").get("_class_name", "FlowMatchEulerDiscreteScheduler")]
    return ["diffusers", read("config.json").get("_class_name", "AutoencoderKL")]


def _model_index(base: Path, staging: Path) -> dict[str, Any]:
    """The base's model_index.json, or one made from the parts' own config files."""
    if (base / "model_index.json").is_file():
        return json.loads((base / "model_index.json").read_text())
    index: dict[str, Any] = {"_class_name": "StableDiffusion3Pipeline",
                             "transformer": ["diffusers", "SD3Transformer2DModel"]}
    for part in PIPELINE_PARTS:
        index[part] = _part_class(staging, part)
    return index


def export(cfg: ExportConfig) -> Path:
    if cfg.checkpoint is None or cfg.out is None:
        raise UserError("export needs --checkpoint DIR (a run's checkpoint.dir or a step-* in it) and --out DIR")
    out = Path(cfg.out)
    _check_out(out)
    if cfg.base is not None and not Path(cfg.base).is_dir():
        raise UserError(f"export.base {cfg.base} is not a folder; pass a local diffusers SD3 folder")
    path = resolve_checkpoint(cfg.checkpoint, cfg.step)
    if read_trainer_state(path).get("mode", "full") == "lora":
        return export_lora(cfg, path, out)
    start = time.perf_counter()
    print(f"[export] reading {path}{' (EMA weights)' if cfg.ema else ''}", flush=True)
    model, state = load_trained_transformer(path, ema=cfg.ema)
    params = sum(p.numel() for p in model.parameters())
    print(f"[export] {params:,} parameters of step {state['step']} read in {time.perf_counter() - start:.1f} s",
          flush=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        model.to(DTYPES[cfg.dtype]).save_pretrained(staging / "transformer", safe_serialization=True,
                                                     max_shard_size=cfg.max_shard_size)
        parts = []
        if cfg.base is not None:
            parts = _copy_base(Path(cfg.base), staging, cfg.link)
            (staging / "model_index.json").write_text(json.dumps(_model_index(Path(cfg.base), staging), indent=2))
        provenance = {"checkpoint": str(path.resolve()), "step": state["step"], "ema": cfg.ema, "dtype": cfg.dtype,
                      "preset": state["model"].get("preset"), "base": str(cfg.base) if cfg.base else None,
                      "base_parts": parts, "time": time.time()}
        (staging / "sd3cluster-export.json").write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    kind = "pipeline folder" if cfg.base is not None else "transformer folder"
    print(f"[export] wrote the {kind} {out} ({cfg.dtype}) in {time.perf_counter() - start:.1f} s", flush=True)
    return out
