"""Checks of a command's inputs that run before it writes or computes anything: paths of the right kind and
writable, a device that exists, known bench variants. Each failure is a UserError naming the setting (its flag
where it has one), the path and what to do; `cli` prints it as one line and exits 2.

The path helpers are the one place the package decides whether a folder or file can be used; the commands'
own modules (generate, serve, export) call them too.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import Config
from .errors import UserError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
# The device setting each command uses, and its flag (None: only `--set`).
DEVICE_KEYS: dict[str, tuple[str, str | None]] = {
    "train": ("train.device", "--device"), "verify": ("train.device", "--device"),
    "generate": ("generate.device", "--device"), "serve": ("serve.device", "--device"),
    "prepare": ("prepare.device", None),
}


def _nearest_existing(path: Path) -> Path:
    return next((p for p in [path, *path.parents] if p.exists()), Path("."))


def _creatable(path: Path, what: str) -> None:
    """`path` does not exist: the nearest existing folder above it must be a folder this user may write."""
    probe = _nearest_existing(path)
    if not probe.is_dir():
        raise UserError(f"{what} {path}: {probe} is a file, so no folder can be made there; pick another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path}: {probe} is not writable by this user; pick another path or fix its "
                        "permissions")


def writable_folder(path: Path, what: str) -> Path:
    """A folder the command will write into: an existing writable folder, or one that can be made."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise UserError(f"{what} {path} is a file, not a folder; name a folder (it is made when missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"{what} {path} is not writable by this user; pick another folder or fix its permissions")
        return path
    _creatable(path, what)
    return path


def writable_file(path: Path, what: str) -> Path:
    """A file the command will (over)write: not a folder, and its folder writable or makeable."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; name a file in it (e.g. {path / 'report.json'})")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UserError(f"{what} {path} is not writable by this user; pick another file or fix its permissions")
        return path
    writable_folder(path.parent if str(path.parent) else Path("."), f"{what} {path}: the folder")
    return path


def existing_folder(path: Path, what: str, hint: str) -> Path:
    """A folder the command reads; `hint` says what it should be (told when it is missing or a file)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{what} {path} does not exist; {hint}")
    if not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a folder; {hint}")
    return path


def check_device(command: str, cfg: Config) -> None:
    """`--device cuda` where torch sees no CUDA device stops here, before any model or file is touched."""
    if command not in DEVICE_KEYS:
        return
    key, flag = DEVICE_KEYS[command]
    section, name = key.split(".")
    device = getattr(getattr(cfg, section), name)
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        named = f"{flag} cuda ({key})" if flag else f"{key}=cuda"
        raise UserError(f"{named}: {why_no_cuda()}; use auto or cpu here (the choices: "
                        f"{', '.join(DEVICE_CHOICES)}; auto takes CUDA when present, else the CPU)")


def why_no_cuda() -> str:
    """The one reason torch sees no CUDA device, of the three there are, so the user fixes the right thing."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch for GPUs"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process"
    return "torch finds no usable GPU or NVIDIA driver on this machine (nvidia-smi shows what the driver sees)"


def preflight(command: str, cfg: Config) -> None:
    """Everything a command's inputs can be checked for before it starts (each command's own module checks what
    needs its data: a prompt file's lines, a checkpoint's description)."""
    check_device(command, cfg)
    if command == "train":
        writable_folder(cfg.output.dir, "output.dir (--output-dir)")
        if cfg.checkpoint.dir is not None:
            writable_folder(cfg.checkpoint.dir, "checkpoint.dir (--checkpoint-dir)")
        if isinstance(cfg.checkpoint.resume, Path):
            existing_folder(cfg.checkpoint.resume, "checkpoint.resume",
                            "give a step-* folder of a run's checkpoint.dir, or auto or never")
        if not cfg.data.synthetic_samples and cfg.data.path is not None:
            existing_folder(cfg.data.path, "data.path (--data)", "give the folder `sd3cluster prepare` wrote")
    elif command == "verify":
        writable_file(cfg.verify.report, "verify.report (--report)")
    elif command == "bench":
        from .bench import Variant

        for spec in cfg.bench.variants:
            Variant.parse(spec)
        if cfg.bench.report is not None:
            writable_file(cfg.bench.report, "bench.report (--report)")
    elif command == "generate" and cfg.generate.out is not None:
        writable_folder(cfg.generate.out, "--out (generate.out)")
    elif command == "serve" and cfg.serve.output_dir is not None:
        writable_folder(cfg.serve.output_dir, "serve.output_dir (--output-dir)")
    elif command == "prepare":
        if cfg.prepare.out is not None:
            writable_folder(cfg.prepare.out, "prepare.out (--out)")
        if not cfg.prepare.synthetic:
            if cfg.prepare.images is not None:
                existing_folder(cfg.prepare.images, "prepare.images (--images)",
                                "give the folder of images with NAME.txt captions beside them")
            if cfg.prepare.encoders is not None:
                existing_folder(cfg.prepare.encoders, "prepare.encoders (--encoders)",
                                "give a local diffusers SD3 folder (vae/, text_encoder*/, tokenizer*/)")
