"""`sd3cluster prepare`: images + captions -> shards of SD3 VAE latents and CLIP-L/CLIP-G/T5 text embeddings.

Encoders come from a local folder laid out as a diffusers SD3 checkpoint: vae/, text_encoder/ (CLIP-L),
text_encoder_2/ (CLIP-G), text_encoder_3/ (T5), tokenizer/, tokenizer_2/, tokenizer_3/. Nothing is downloaded.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .components import encode_prompts, load_encoders
from .config import Config
from .data import ShardWriter, write_synthetic_shards
from .errors import DataError
from .models import text_dims

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """RGB, resized so the short side is `resolution`, center-cropped square, scaled to [-1, 1]."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as raw:
            img = raw.convert("RGB")
            scale = resolution / min(img.size)
            img = img.resize((max(resolution, round(img.width * scale)), max(resolution, round(img.height * scale))),
                             Image.BICUBIC)
            left, top = (img.width - resolution) // 2, (img.height - resolution) // 2
            img = img.crop((left, top, left + resolution, top + resolution))
            array = np.asarray(img, dtype=np.float32)
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"image {path} cannot be read ({e}); remove or replace it") from None
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1.0


def image_size(path: Path) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.size
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"image {path} cannot be read ({e}); remove or replace it") from None


def load_bucketed(path: Path, bucket: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """RGB resized to cover `bucket` (width, height) and center-cropped to it, in [-1, 1]; the original size and
    the crop's (left, top) in the resized image."""
    from PIL import Image, UnidentifiedImageError

    from .buckets import cover_and_crop

    try:
        with Image.open(path) as raw:
            img = raw.convert("RGB")
            original = img.size
            resized, (left, top) = cover_and_crop(*original, bucket)
            img = img.resize(resized, Image.BICUBIC).crop((left, top, left + bucket[0], top + bucket[1]))
            array = np.asarray(img, dtype=np.float32)
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"image {path} cannot be read ({e}); remove or replace it") from None
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1.0, original, (left, top)


def find_pairs(folder: Path) -> list[tuple[Path, str]]:
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"prepare.images {folder} is not a folder; point it at your images and NAME.txt captions")
    images = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise DataError(f"prepare.images {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    pairs = []
    for img in images:
        caption = img.with_suffix(".txt")
        if not caption.is_file():
            raise DataError(f"image {img} has no caption file {caption.name} beside it; add one (one line of text)")
        pairs.append((img, caption.read_text().strip()))
    return pairs


def prepare(cfg: Config) -> Path:
    p = cfg.prepare
    if p.out is None:
        raise DataError("prepare.out is not set: name the folder the shards go to (--out DIR)")
    if p.synthetic:
        joint, pooled = text_dims(cfg.model.preset)
        side = cfg.data.resolution // 8
        index = write_synthetic_shards(p.out, p.synthetic, (16, side, side), cfg.data.text_tokens, joint, pooled,
                                       p.shard_size, cfg.data.seed)
        print(f"[prepare] {p.synthetic} synthetic samples for {cfg.model.preset} -> {index}")
        return index
    if p.images is None or p.encoders is None:
        raise DataError("prepare needs prepare.images (--images DIR) and prepare.encoders (--encoders DIR), "
                        "or prepare.synthetic=N")
    device = torch.device("cuda" if p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    pairs = find_pairs(p.images)
    start = time.perf_counter()
    enc = load_encoders(p.encoders, device, what="prepare.encoders")
    scaling = float(enc.vae.config.scaling_factor)
    shift = float(enc.vae.config.shift_factor or 0.0)
    print(f"[prepare] {len(pairs)} images, encoders loaded in {time.perf_counter() - start:.1f} s "
          f"(VAE scaling {scaling}, shift {shift})", flush=True)
    writer = ShardWriter(p.out, p.shard_size, meta={"source": str(p.images), "resolution": cfg.data.resolution,
                                                    "vae_scaling": scaling, "vae_shift": shift})
    gen = torch.Generator(device=device).manual_seed(cfg.data.seed)
    if p.buckets:
        return _prepare_bucketed(cfg, pairs, enc, writer, gen, device, start)
    for i in range(0, len(pairs), p.batch_size):
        chunk = pairs[i:i + p.batch_size]
        pixels = torch.stack([load_image(path, cfg.data.resolution) for path, _ in chunk]).to(device)
        with torch.no_grad():
            latents = enc.vae.encode(pixels).latent_dist.sample(generator=gen)
        latents = (latents - shift) * scaling
        embeds, pooled = encode_prompts(enc, [c for _, c in chunk], p.clip_tokens, p.t5_tokens, device)
        writer.add(latents, embeds, pooled)
        print(f"[prepare] {min(i + p.batch_size, len(pairs))}/{len(pairs)} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    index = writer.close()
    print(f"[prepare] wrote {len(writer.shards)} shard(s) -> {index}")
    return index


def _prepare_bucketed(cfg: Config, pairs: list[tuple[Path, str]], enc, writer: ShardWriter, gen: torch.Generator,
                      device: torch.device, start: float) -> Path:
    """Every image into the bucket nearest its aspect ratio; VAE batches of one bucket; one bucket per shard."""
    from .buckets import bucket_set, nearest_bucket

    p = cfg.prepare
    buckets = bucket_set(cfg.data.resolution, p.bucket_step, p.max_aspect)
    scaling = float(enc.vae.config.scaling_factor)
    shift = float(enc.vae.config.shift_factor or 0.0)
    groups: dict[tuple[int, int], list[tuple[Path, str]]] = {}
    for path, caption in pairs:
        groups.setdefault(nearest_bucket(*image_size(path), buckets), []).append((path, caption))
    print(f"[prepare] {len(buckets)} buckets at {cfg.data.resolution}^2 pixels (step {p.bucket_step}); used: "
          + ", ".join(f"{w}x{h}: {len(v)}" for (w, h), v in sorted(groups.items())), flush=True)
    done = 0
    for bucket, members in sorted(groups.items()):
        for i in range(0, len(members), p.batch_size):
            chunk = members[i:i + p.batch_size]
            loaded = [load_bucketed(path, bucket) for path, _ in chunk]
            pixels = torch.stack([t for t, _, _ in loaded]).to(device)
            with torch.no_grad():
                latents = enc.vae.encode(pixels).latent_dist.sample(generator=gen)
            latents = (latents - shift) * scaling
            embeds, pooled = encode_prompts(enc, [c for _, c in chunk], p.clip_tokens, p.t5_tokens, device)
            extra = {"original_size": torch.tensor([o for _, o, _ in loaded], dtype=torch.int32),
                     "crop": torch.tensor([c for _, _, c in loaded], dtype=torch.int32)}
            writer.add(latents, embeds, pooled, bucket=bucket, extra=extra)
            done += len(chunk)
            print(f"[prepare] {done}/{len(pairs)} ({time.perf_counter() - start:.1f} s)", flush=True)
    writer.meta["bucket_step"] = p.bucket_step
    writer.meta["max_aspect"] = p.max_aspect
    index = writer.close()
    print(f"[prepare] wrote {len(writer.shards)} shard(s) in {len(groups)} bucket(s) -> {index}")
    return index
