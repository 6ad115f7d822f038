"""The `sd3cluster` command: prepare | train | verify | bench, all on one validated configuration."""

from __future__ import annotations

import argparse
import sys

from .config import Config, load_config
from .errors import UserError

# Convenience flags: each one is a shorthand for `--set KEY=VALUE`.
SHORTCUTS: dict[str, list[tuple[str, str, str]]] = {
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
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sd3cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {"prepare": "images + captions -> latent and embedding shards (or synthetic shards)",
             "train": "rectified-flow training (torchrun for several ranks)",
             "verify": "checks with numbers and a verdict; non-zero exit on any failure",
             "bench": "training-step throughput and MFU of model variants"}
    for name, shortcuts in SHORTCUTS.items():
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("--config", help="YAML file with any of the sections model/data/flow/optim/train/...")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config key, e.g. --set train.steps=10 (repeatable)")
        p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
        for flag, key, text in shortcuts:
            p.add_argument(flag, dest=key, default=None, help=f"{text} (= --set {key}=...)")
    return parser


def resolve(args: argparse.Namespace) -> Config:
    overrides = []
    for _, key, _ in SHORTCUTS[args.command]:
        value = getattr(args, key)
        if value is not None:
            if key == "bench.variants":
                value = "[" + ",".join(f'"{v}"' for v in value.split(";" if ";" in value else ",")) + "]"
            overrides.append(f"{key}={value}")
    return load_config(args.config, overrides + args.overrides)


def _run(args: argparse.Namespace, cfg: Config) -> int:
    if args.command == "prepare":
        from .prepare import prepare

        print(cfg.pretty(), flush=True)
        prepare(cfg)
        return 0
    if args.command == "bench":
        from .bench import run_bench

        print(cfg.pretty(), flush=True)
        run_bench(cfg)
        return 0
    from .dist import init_runtime

    rt = init_runtime(cfg.train.device)
    try:
        if rt.is_main:
            print(f"sd3cluster {args.command}: configuration\n{cfg.pretty()}", flush=True)
        if args.command == "train":
            from .train import train

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = resolve(args)
        if args.print_config:
            print(cfg.pretty())
            return 0
        return _run(args, cfg)
    except UserError as e:
        print(f"sd3cluster {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
