"""The `sd3cluster` command: prepare | train | verify | bench | export | generate | serve, on one validated
configuration."""

from __future__ import annotations

import argparse
import os
import sys

from .checks import preflight
from .config import Config, load_config
from .errors import UserError

DEBUG_ENV = "SD3CLUSTER_DEBUG"
# The exit status of every error the user can fix (argparse's own for a bad command line is 2 too).
USER_ERROR_STATUS = 2

# Convenience flags: each one is a shorthand for `--set KEY=VALUE`; a fourth element "switch" makes it a
# flag without a value (`--ema` = `--set export.ema=true`).
SHORTCUTS: dict[str, list[tuple[str, ...]]] = {
    "prepare": [("--images", "prepare.images", "folder of images with NAME.txt captions"),
                ("--encoders", "prepare.encoders", "local SD3 folder with the VAE and text encoders"),
                ("--out", "prepare.out", "output folder of the shards"),
                ("--synthetic", "prepare.synthetic", "write N synthetic samples instead"),
                ("--preset", "model.preset", "model preset (shapes of synthetic samples)"),
                ("--resolution", "data.resolution", "image side in pixels")],
    "train": [("--preset", "model.preset", "tiny | sd3-medium | sd35-medium | sd35-large"),
              ("--pretrained", "model.pretrained", "local diffusers weights"),
              ("--data", "data.path", "folder of shards from `prepare`"),
              ("--steps", "train.steps", "optimizer steps"),
              ("--batch-size", "data.batch_size", "samples per rank per micro-step"),
              ("--parallel", "train.parallel", "ddp | fsdp"),
              ("--mode", "train.mode", "full | lora (adapters only; section lora:)"),
              ("--lora-rank", "lora.rank", "rank of the LoRA adapters"),
              ("--checkpoint-dir", "checkpoint.dir", "checkpoints (on the shared volume)"),
              ("--output-dir", "output.dir", "metrics.jsonl and TensorBoard"),
              ("--device", "train.device", "auto | cpu | cuda")],
    "verify": [("--preset", "model.preset", "model of the training checks (tiny by default)"),
               ("--report", "verify.report", "JSON report path"),
               ("--device", "train.device", "auto | cpu | cuda"),
               ("--gpu-profile", "verify.gpu_profile", "hardware profile of the GPUs (auto: from their name)"),
               ("--network-profile", "verify.network_profile", "NIC profile between nodes (eth-100g, ib-ndr...)"),
               ("--threshold-fraction", "verify.threshold_fraction", "threshold = profile's expected value x this"),
               ("--min-busbw", "verify.min_busbw_gbps", "all-reduce threshold, GB/s (replaces the profile's)"),
               ("--min-images-per-s", "verify.min_images_per_s", "throughput threshold of the correctness run")],
    "bench": [("--preset", "model.preset", "model preset"),
              ("--resolution", "data.resolution", "image side in pixels"),
              ("--batch-size", "data.batch_size", "batch per step"),
              ("--variants", "bench.variants", "comma-separated variants (reference,optimized,...)"),
              ("--report", "bench.report", "JSON results path")],
    "export": [("--checkpoint", "export.checkpoint", "a run's checkpoint folder, or one step-* in it"),
               ("--step", "export.step", "step to export (default: the newest complete one)"),
               ("--out", "export.out", "diffusers folder to write (new or empty)"),
               ("--base", "export.base", "local diffusers SD3 folder: write a whole pipeline folder"),
               ("--dtype", "export.dtype", "bf16 | fp32"),
               ("--ema", "export.ema", "export the EMA weights", "switch"),
               ("--link", "export.link", "symlink the base's parts instead of copying them", "switch")],
    "generate": [("--prompts", "generate.prompts", "prompt file: .txt (a line each) or .jsonl"),
                 ("--out", "generate.out", "folder of images/ and manifest.jsonl"),
                 ("--pretrained", "generate.pretrained", "local diffusers SD3 folder"),
                 ("--checkpoint", "generate.checkpoint", "training checkpoint (the transformer comes from it)"),
                 ("--step", "generate.step", "checkpoint step (default: newest complete)"),
                 ("--preset", "model.preset", "random-weight model of this preset when no weights are given"),
                 ("--steps", "generate.steps", "sampling steps"),
                 ("--guidance", "generate.guidance", "classifier-free guidance scale"),
                 ("--size", "generate.size", "image size: N or WIDTHxHEIGHT, multiples of 16"),
                 ("--negative-prompt", "generate.negative_prompt", "negative prompt of every image"),
                 ("--images-per-prompt", "generate.images_per_prompt", "images of each prompt"),
                 ("--batch-size", "generate.batch_size", "images per forward pass and rank"),
                 ("--seed", "generate.seed", "base seed"),
                 ("--dtype", "generate.dtype", "auto | bf16 | fp16 | fp32"),
                 ("--device", "generate.device", "auto | cpu | cuda"),
                 ("--lora", "generate.lora", "diffusers-format LoRA file (or its export folder) to apply"),
                 ("--lora-scale", "generate.lora_scale", "strength of the LoRA (1: as trained)"),
                 ("--ema", "generate.ema", "the checkpoint's EMA weights", "switch"),
                 ("--compile", "generate.compile", "torch.compile each transformer block", "switch"),
                 ("--cfg-parallel", "generate.cfg_parallel", "guided passes on two ranks (even rank count)",
                  "switch")],
    "serve": [("--host", "serve.host", "address to listen on"),
              ("--port", "serve.port", "port (default 5000)"),
              ("--pretrained", "serve.pretrained", "local diffusers SD3 folder"),
              ("--checkpoint", "serve.checkpoint", "training checkpoint (the transformer comes from it)"),
              ("--step", "serve.step", "checkpoint step (default: newest complete)"),
              ("--preset", "model.preset", "random-weight model of this preset when no weights are given"),
              ("--device", "serve.device", "auto | cpu | cuda (CUDA_VISIBLE_DEVICES picks the GPU)"),
              ("--dtype", "serve.dtype", "auto | bf16 | fp16 | fp32"),
              ("--output-dir", "serve.output_dir", "folder of response_format=path images"),
              ("--max-batch", "serve.max_batch", "images per forward pass"),
              ("--lora", "serve.lora", "diffusers-format LoRA file (or its export folder) to apply"),
              ("--lora-scale", "serve.lora_scale", "strength of the LoRA (1: as trained)"),
              ("--ema", "serve.ema", "the checkpoint's EMA weights", "switch"),
              ("--compile", "serve.compile", "torch.compile each transformer block and the VAE decoder", "switch")],
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sd3cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {"prepare": "images + captions -> latent and embedding shards (torchrun: ranks share the shards)",
             "train": "rectified-flow training (torchrun for several ranks)",
             "verify": "checks with numbers and a verdict; non-zero exit on any failure",
             "bench": "training-step throughput and MFU of model variants",
             "export": "training checkpoint -> diffusers folder (transformer, or a whole pipeline with --base)",
             "generate": "prompt file -> PNG images and manifest.jsonl (torchrun: one process per GPU)",
             "serve": "HTTP image service of one GPU (POST /v1/images/generations, /v1/jobs, /metrics)"}
    for name, shortcuts in SHORTCUTS.items():
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--config", help="YAML file with any of the sections model/data/flow/optim/train/...")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config key, e.g. --set train.steps=10 (repeatable)")
        p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
        p.add_argument("--debug", action="store_true",
                       help=f"on an error, show Python's full traceback instead of one line (for bug reports; "
                            f"also {DEBUG_ENV}=1)")
        for flag, key, text, *kind in shortcuts:
            if kind == ["switch"]:
                p.add_argument(flag, dest=key, action="store_const", const="true", default=None,
                               help=f"{text} (= --set {key}=true)")
            else:
                p.add_argument(flag, dest=key, default=None, help=f"{text} (= --set {key}=...)")
    return parser


def _size_overrides(value: str) -> list[str]:
    """`--size 1024` or `--size 1024x768` -> generate.width / generate.height (validated with the config)."""
    width, sep, height = value.lower().partition("x")
    return [f"generate.width={width.strip()}", f"generate.height={(height if sep else width).strip()}"]


def resolve(args: argparse.Namespace) -> Config:
    overrides = []
    for _, key, *_ in SHORTCUTS[args.command]:
        value = getattr(args, key)
        if value is not None:
            if key == "generate.size":
                overrides += _size_overrides(value)
                continue
            if key == "bench.variants":
                value = "[" + ",".join(f'"{v}"' for v in value.split(";" if ";" in value else ",")) + "]"
            overrides.append(f"{key}={value}")
    return load_config(args.config, overrides + args.overrides)


def _run(args: argparse.Namespace, cfg: Config) -> int:
    if args.command == "bench":
        from .bench import run_bench

        print(cfg.pretty(), flush=True)
        run_bench(cfg)
        return 0
    if args.command == "serve":
        from .serve import serve

        _quiet_libraries()
        return serve(cfg)
    if args.command == "export":
        from .export import export

        _quiet_libraries()
        export(cfg.export)
        return 0
    from .dist import init_runtime

    devices = {"generate": cfg.generate.device, "prepare": cfg.prepare.device}
    rt = init_runtime(devices.get(args.command, cfg.train.device))
    try:
        if args.command == "prepare":
            from .prepare import prepare

            if rt.is_main:
                print(cfg.pretty(), flush=True)
            prepare(cfg, rt)
            return 0
        if args.command == "generate":
            from .generate import generate

            _quiet_libraries()
            generate(cfg, rt)
            return 0
        if rt.is_main:
            print(f"sd3cluster {args.command}: configuration\n{cfg.pretty()}", flush=True)
        if args.command == "train":
            from .train import train

            _quiet_libraries()
            result = train(cfg, rt)
            if rt.is_main:
                print(f"done: step {result['step']}, loss {result.get('loss', float('nan')):.4f}", flush=True)
            return 0
        from .verify import verify

        return 0 if verify(cfg, rt).passed else 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _quiet_libraries() -> None:
    """Library chatter that is no use to a user of these commands: diffusers' dtype advice on casts we mean
    (generate, export, train's previews), DCP's note that it reads in one process (export and generate do)."""
    import warnings

    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def user_error_message(e: BaseException) -> str | None:
    """The one-line message of an error the user can act on, or None for a bug (which keeps its traceback).

    UserError says what and where itself. An OSError that names its file (a folder made read-only, a full disk)
    comes from an I/O boundary of the package that had no check for it: the file and the system's reason are
    what the user needs."""
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, OSError) and e.filename:
        reason = e.strerror or str(e)
        return f"{e.filename}: {reason}; check that path (that it exists, is of the right kind and writable)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve(args)
        if args.print_config:
            print(cfg.pretty())
            return 0
        # Inputs are checked before anything is written or computed: a run that stops here changed nothing.
        preflight(args.command, cfg)
        return _run(args, cfg)
    except (UserError, OSError) as e:
        message = user_error_message(e)
        if message is None or debug_requested(args):
            raise
        # Every rank of a torchrun launch meets the same input error; rank 0 says it once.
        if os.environ.get("RANK", "0") == "0":
            print(f"sd3cluster {args.command}: error: {message}", file=sys.stderr, flush=True)
        return USER_ERROR_STATUS


if __name__ == "__main__":
    raise SystemExit(main())
