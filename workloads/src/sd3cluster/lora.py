"""LoRA adapters on SD3's transformer through peft, and the diffusers-format file that carries them.

Training (train.mode=lora): the base is frozen, peft puts an adapter (x -> (alpha / r) B A x, B starting at zero)
beside each target linear of the joint blocks, and only the adapters and their optimizer state train and go into
checkpoints. Under model.fuse_qkv the adapter of a fused q/k/v layer is one A (r x d) and one B (3d x r); it is
exactly three adapters sharing A, which is how it is exported.

The exported file is what diffusers' own LoRA scripts write and `StableDiffusion3Pipeline.load_lora_weights`
reads: `transformer.<module>.lora_A.weight` / `.lora_B.weight` in diffusers' module names, with alpha / r folded
into B (loaders then use their default alpha = r, so the file means the same in every loader version).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import LoraSection
from .errors import CheckpointError, UserError

LORA_FILE = "pytorch_lora_weights.safetensors"
# A fused layer's name -> the diffusers layers it joins, in the order fuse_qkv concatenated them.
FUSED = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}
_UNFUSED = {part: fused for fused, parts in FUSED.items() for part in parts}
_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError("train.mode=lora needs peft: pip install peft==0.21.2 (see requirements.txt)") from None


def trained_suffixes(targets: list[str], fused: bool) -> list[str]:
    """The names, inside a joint block, of the modules that get adapters (fused names under fuse_qkv)."""
    out: list[str] = []
    for target in targets:
        parent, _, leaf = target.rpartition(".")
        name = f"{parent}.{_UNFUSED[leaf]}" if fused and leaf in _UNFUSED else target
        if name not in out:
            out.append(name)
    return out


def diffusers_targets(suffix: str) -> list[str]:
    """The diffusers names of one trained module suffix (three for a fused q/k/v layer)."""
    parent, _, leaf = suffix.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED[leaf]] if leaf in FUSED else [suffix]


def _regex(suffixes: list[str]) -> str:
    return r"transformer_blocks\.\d+\.(" + "|".join(re.escape(s) for s in suffixes) + ")"


def apply_lora(model: nn.Module, section: LoraSection, fused: bool, seed: int = 0) -> list[str]:
    """Freeze `model` and inject the adapters in place (seeded: every rank and every resume builds the same A).
    Returns the trained parameter names in order (what the optimizer and EMA hold)."""
    require_peft()
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    regex = _regex(trained_suffixes(section.target_modules, fused))
    if not any(re.fullmatch(regex, name) and isinstance(m, nn.Linear) for name, m in model.named_modules()):
        raise UserError(f"lora.target_modules ({', '.join(section.target_modules)}) match no linear layer of this "
                        "model (SD3's second attention, attn2, exists only in SD3.5-medium)")
    config = LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                        target_modules=regex, init_lora_weights=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def describe(section: LoraSection, fused: bool, names: list[str]) -> dict[str, Any]:
    """What a checkpoint records of its adapters: resume and export check it and rebuild from it."""
    return {"rank": section.rank, "alpha": section.alpha, "target_modules": list(section.target_modules),
            "fused": fused, "parameters": names}


def _suffix(param_name: str) -> str:
    module = param_name.split(".lora_", 1)[0]
    m = _BLOCK.match(module)
    return m.group(2) if m else module


def group_lr_of(suffix: str, group_lr: dict[str, float], base_lr: float) -> float:
    """The learning rate of one trained module: the longest group_lr key that is a prefix of its targets."""
    lrs = set()
    for target in diffusers_targets(suffix):
        keys = [k for k in group_lr if target == k or target.startswith(k + ".")]
        lrs.add(group_lr[max(keys, key=len)] if keys else base_lr)
    if len(lrs) > 1:
        raise UserError(f"lora.group_lr gives {', '.join(diffusers_targets(suffix))} different learning rates, but "
                        "model.fuse_qkv joins them into one layer; give them one rate or set model.fuse_qkv=false")
    return lrs.pop()


def param_groups(model: nn.Module, section: LoraSection, base_lr: float) -> list[dict[str, Any]]:
    """Optimizer groups of the adapters by learning rate, in parameter order (the same on every rank)."""
    groups: dict[float, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(group_lr_of(_suffix(name), section.group_lr, base_lr), []).append(p)
    return [{"params": params, "lr": lr} for lr, params in groups.items()]


def check_checkpoint_kind(path: Path, state: dict[str, Any], mode: str, lora: dict[str, Any] | None) -> None:
    """Refuse a checkpoint of the other kind, or adapters of another shape, before any tensor is read."""
    found = state.get("mode", "full")
    if found != mode:
        if mode == "lora":
            raise CheckpointError(f"checkpoint {path} holds a full model (train.mode=full), not LoRA adapters; "
                                  "point checkpoint.dir at a LoRA run's folder (or set checkpoint.resume=never); "
                                  "to start LoRA from those weights, export them and pass the folder as "
                                  "model.pretrained")
        raise CheckpointError(f"checkpoint {path} holds LoRA adapters (train.mode=lora), not a full model; set "
                              "train.mode=lora to resume it, or point checkpoint.dir elsewhere")
    if lora is not None:
        saved = state.get("lora") or {}
        differ = [k for k in ("rank", "alpha", "target_modules", "fused") if saved.get(k) != lora.get(k)]
        if differ:
            shown = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, config {lora.get(k)!r}" for k in differ)
            raise CheckpointError(f"checkpoint {path} holds other adapters than lora: asks for ({shown}); set the "
                                  "lora section as that run had it, or point checkpoint.dir elsewhere")


# -- the diffusers-format file ----------------------------------------------------------------------------------
def to_diffusers(adapters: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """peft adapter tensors (`<module>.lora_A.default.weight`, trained names) -> the diffusers LoRA file's."""
    scale = alpha / rank
    out: dict[str, torch.Tensor] = {}
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.", 1)[0]
        b = adapters[key.replace(".lora_A.", ".lora_B.")] * scale
        parent, _, leaf = module.rpartition(".")
        if leaf in FUSED:
            for part, b_part in zip(FUSED[leaf], b.chunk(3, dim=0), strict=True):
                out[f"transformer.{parent}.{part}.lora_A.weight"] = a.clone()
                out[f"transformer.{parent}.{part}.lora_B.weight"] = b_part.contiguous()
        else:
            out[f"transformer.{module}.lora_A.weight"] = a.clone()
            out[f"transformer.{module}.lora_B.weight"] = b.contiguous()
    return out


def lora_file(path: Path, what: str = "--lora") -> Path:
    path = Path(path)
    if path.is_dir():
        if (path / LORA_FILE).is_file():
            return path / LORA_FILE
        if (path / "transformer").is_dir() or (path / "config.json").is_file():
            raise UserError(f"{what} {path} is a full model folder, not a LoRA; pass it as --pretrained, or pass the "
                            f"folder `sd3cluster export` wrote for a LoRA run (it holds {LORA_FILE})")
        raise UserError(f"{what} {path} holds no {LORA_FILE}; pass that file or the folder of a LoRA export")
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist; pass a LoRA .safetensors file or its export folder")
    return path


def read_lora(path: Path, what: str = "--lora") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The file's adapters: diffusers module name -> (A, B). Refuses anything that is not a transformer LoRA."""
    from safetensors.torch import load_file

    file = lora_file(path, what)
    try:
        tensors = load_file(str(file))
    except Exception as e:
        raise UserError(f"{what} {file} is not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
    adapters = [k for k in tensors if ".lora_A." in k or ".lora_B." in k or ".lora_down." in k or ".lora_up." in k]
    if not adapters:
        raise UserError(f"{what} {file} holds no LoRA tensors (lora_A/lora_B): it looks like full model weights; "
                        "pass those as --pretrained")
    foreign = sorted({k.split(".", 1)[0] for k in adapters if not k.startswith("transformer.")})
    if foreign or any(".lora_down." in k for k in adapters):
        raise UserError(f"{what} {file} is not a diffusers-format SD3 transformer LoRA (keys start with "
                        f"{', '.join(foreign) or 'lora_down/lora_up'}); convert it with diffusers first")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in adapters:
        if ".lora_A." not in key:
            continue
        module = key[len("transformer."):].split(".lora_A.", 1)[0]
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in tensors:
            raise UserError(f"{what} {file}: {key} has no lora_B partner; the file is damaged")
        out[module] = (tensors[key], tensors[b_key])
    return out


@torch.no_grad()
def merge_lora(model: nn.Module, path: Path, scale: float = 1.0, what: str = "--lora") -> int:
    """W += scale * B A for every adapter of the file, into an unfused diffusers transformer. Returns the count."""
    adapters = read_lora(path, what)
    modules = dict(model.named_modules())
    for name, (a, b) in adapters.items():
        layer = modules.get(name)
        if not isinstance(layer, nn.Linear):
            raise UserError(f"{what} {path}: it adapts {name}, which this transformer does not have; was it trained "
                            "for another model (SD3 vs SD3.5, other depth)?")
        if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features or a.shape[0] != b.shape[1]:
            raise UserError(f"{what} {path}: {name} is {layer.out_features}x{layer.in_features} but the adapter is "
                            f"{tuple(b.shape)} x {tuple(a.shape)}; it was trained for another model")
    for name, (a, b) in adapters.items():
        weight = modules[name].weight
        delta = (b.float() @ a.float()) * scale
        weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
    return len(adapters)
