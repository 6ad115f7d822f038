"""`sd3cluster prepare`: images + captions -> shards of SD3 VAE latents and CLIP-L/CLIP-G/T5 text embeddings.

Encoders come from a local folder laid out as a diffusers SD3 checkpoint: vae/, text_encoder/ (CLIP-L),
text_encoder_2/ (CLIP-G), text_encoder_3/ (T5), tokenizer/, tokenizer_2/, tokenizer_3/. Nothing is downloaded.

Over many ranks (torchrun): the work is cut into shards before anything is encoded, the same way for every rank
count (images in path order, per bucket with buckets, `shard_size` at a time), and shard k goes to rank
k mod world. Each sample's VAE noise comes from its own seed (data.seed and the image's path), so a shard's bytes do
not depend on which rank made it or how many ranks ran. Shards are written to a hidden temporary name and renamed;
one whose metadata names this run's plan is finished, and a rerun (or a requeued job) makes only the others.
Rank 0 writes index.json once every rank is done. prepare.json keeps the settings and the fingerprint of the
images; a rerun into the same folder with other settings or other images is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .components import encode_prompts, load_encoders, missing_parts
from .config import Config
from .data import INDEX, save_shard, shard_metadata, shard_name, write_index, write_synthetic_shards
from .dist import Runtime, all_gather_object, barrier, local_runtime, pick_device, raise_on_all
from .errors import DataError, UserError
from .files import keep_settings, remove_temporaries
from .models import text_dims
from .progress import Progress

PLAN = "prepare.json"

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


@dataclass(frozen=True)
class Unit:
    """One shard's work: its number, its bucket (None: square crops) and its (image, caption) pairs in order."""

    number: int
    bucket: tuple[int, int] | None
    items: tuple[tuple[Path, str], ...]

    @property
    def file(self) -> str:
        return shard_name(self.number)


def read_headers(rt: Runtime, pairs: list[tuple[Path, str]]) -> list[tuple[int, int, int]]:
    """(width, height, bytes) of every image; rank r reads the headers of images r, r + world, ... and every rank
    gets them all. An unreadable image stops every rank with its name (it would stop the encoding later)."""
    mine: list[tuple[int, int, int]] = []
    error = None
    try:
        mine = [(*image_size(path), path.stat().st_size) for path, _ in pairs[rt.rank::rt.world]]
    except (DataError, OSError) as e:
        error = str(e)
    raise_on_all(rt, error)
    headers: list = [None] * len(pairs)
    for rank, part in enumerate(all_gather_object(rt, mine)):
        headers[rank::rt.world] = part
    return headers


def plan_units(pairs: list[tuple[Path, str]], headers: list[tuple[int, int, int]], cfg: Config) -> list[Unit]:
    """The shards of this input, numbered: a function of the images and settings only, never of the rank count."""
    from .buckets import bucket_set, nearest_bucket

    p = cfg.prepare
    runs: list[tuple[tuple[int, int] | None, list[tuple[Path, str]]]]
    if p.buckets:
        buckets = bucket_set(cfg.data.resolution, p.bucket_step, p.max_aspect)
        groups: dict[tuple[int, int], list[tuple[Path, str]]] = {}
        for pair, (width, height, _) in zip(pairs, headers, strict=True):
            groups.setdefault(nearest_bucket(width, height, buckets), []).append(pair)
        runs = sorted(groups.items())
    else:
        runs = [(None, pairs)]
    units: list[Unit] = []
    for bucket, members in runs:
        for i in range(0, len(members), p.shard_size):
            units.append(Unit(len(units), bucket, tuple(members[i:i + p.shard_size])))
    return units


def run_settings(cfg: Config, pairs: list[tuple[Path, str]], headers: list[tuple[int, int, int]]) -> dict:
    """What decides the shards' content (not how fast they are made): a rerun must match it to continue a folder.
    The images enter as a fingerprint of their paths, captions, sizes and byte counts."""
    p = cfg.prepare
    images = Path(p.images).resolve()
    digest = hashlib.sha256()
    for (path, caption), header in zip(pairs, headers, strict=True):
        digest.update(json.dumps([relative_name(p.images, path), caption, list(header)]).encode() + b"\n")
    return {"images": str(images), "images_sha256": digest.hexdigest(), "images_count": len(pairs),
            "encoders": str(Path(p.encoders).resolve()), "resolution": cfg.data.resolution, "seed": cfg.data.seed,
            "buckets": p.buckets, "bucket_step": p.bucket_step, "max_aspect": p.max_aspect,
            "shard_size": p.shard_size, "clip_tokens": p.clip_tokens, "t5_tokens": p.t5_tokens}


def plan_id(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def relative_name(images: Path, path: Path) -> str:
    """An image's name under the images folder, as found there (a symlinked image keeps its own name)."""
    return Path(path).relative_to(Path(images)).as_posix()


def sample_seed(seed: int, images: Path, path: Path) -> int:
    """The VAE noise seed of one image: from data.seed and its path under the images folder, so it does not
    depend on the batch, the shard or the rank the image lands in."""
    name = relative_name(images, path)
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def check_out(out: Path | None) -> Path:
    if out is None:
        raise DataError("prepare.out is not set: name the folder the shards go to (--out DIR)")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataError(f"prepare.out {out} is a file; name a folder for the shards")
    return out


def _claim_folder(out: Path, settings: dict) -> int:
    """Rank 0, before any rank writes: the folder is this run's (or new), and killed writers' temporaries are
    gone. Returns how many temporaries were removed."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / PLAN).is_file() and ((out / INDEX).is_file() or any(out.glob("shard-*.safetensors"))):
        raise DataError(f"prepare.out {out} holds shards that another prepare run wrote (no {PLAN} beside them); "
                        "pick a new --out folder or empty this one")
    differ = keep_settings(out / PLAN, settings)
    if differ:
        raise DataError(f"prepare.out {out} holds shards made from other images or settings "
                        f"({'; '.join(differ)}); pick a new --out folder, or rerun with the old settings to finish")
    return remove_temporaries(out, "shard-*")


def _finished(out: Path, unit: Unit, plan: str) -> bool:
    meta = shard_metadata(out / unit.file)
    return meta is not None and meta.get("plan") == plan


def encode_unit(unit: Unit, enc, cfg: Config, device: torch.device, scaling: float, shift: float
                ) -> dict[str, torch.Tensor]:
    """The tensors of one shard: latents, prompt_embeds, pooled (float32) and, with buckets, each sample's
    original_size and crop (int32). VAE and text encoders run `prepare.batch_size` images at a time."""
    p = cfg.prepare
    parts: dict[str, list[torch.Tensor]] = {}
    for i in range(0, len(unit.items), p.batch_size):
        chunk = unit.items[i:i + p.batch_size]
        extra = {}
        if unit.bucket is None:
            pixels = torch.stack([load_image(path, cfg.data.resolution) for path, _ in chunk])
        else:
            loaded = [load_bucketed(path, unit.bucket) for path, _ in chunk]
            pixels = torch.stack([t for t, _, _ in loaded])
            extra = {"original_size": torch.tensor([o for _, o, _ in loaded], dtype=torch.int32),
                     "crop": torch.tensor([c for _, _, c in loaded], dtype=torch.int32)}
        with torch.no_grad():
            posterior = enc.vae.encode(pixels.to(device)).latent_dist
            noise = torch.stack([
                torch.randn(posterior.mean.shape[1:], device=device, dtype=posterior.mean.dtype,
                            generator=torch.Generator(device).manual_seed(sample_seed(cfg.data.seed, p.images, path)))
                for path, _ in chunk])
            latents = (posterior.mean + posterior.std * noise - shift) * scaling
        embeds, pooled = encode_prompts(enc, [c for _, c in chunk], p.clip_tokens, p.t5_tokens, device)
        for key, t in {"latents": latents, "prompt_embeds": embeds, "pooled": pooled}.items():
            parts.setdefault(key, []).append(t.detach().float().cpu())
        for key, t in extra.items():
            parts.setdefault(key, []).append(t)
    return {key: torch.cat(v) for key, v in parts.items()}


def _vae_factors(encoders: Path) -> tuple[float, float]:
    """Scaling and shift of the VAE's latents, from its config (no weights are loaded for it)."""
    from diffusers import AutoencoderKL

    try:
        config = AutoencoderKL.load_config(Path(encoders) / "vae", local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"prepare.encoders {encoders}: vae/config.json cannot be read ({str(e).splitlines()[0]})"
                        ) from None
    return float(config["scaling_factor"]), float(config.get("shift_factor") or 0.0)


def _maybe_kill(cfg: Config, rt: Runtime, written: int) -> None:
    """Test hook: a rank dies hard (as a lost node would) between two shards, on the first attempt only."""
    p = cfg.prepare
    if p.kill_after_shards and written == p.kill_after_shards and rt.rank == p.kill_rank and rt.restart_count == 0:
        print(f"[rank {rt.rank}] fault injection: SIGKILL after {written} shard(s)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def prepare(cfg: Config, rt: Runtime | None = None) -> Path:
    """Writes the shards and index.json of `cfg.prepare`; every rank of `rt` takes part. Returns the index path."""
    p = cfg.prepare
    rt = rt or local_runtime(pick_device(p.device))
    out = check_out(p.out)
    if p.synthetic:
        if rt.is_main:
            joint, pooled = text_dims(cfg.model.preset)
            side = cfg.data.resolution // 8
            write_synthetic_shards(out, p.synthetic, (16, side, side), cfg.data.text_tokens, joint, pooled,
                                   p.shard_size, cfg.data.seed)
            print(f"[prepare] {p.synthetic} synthetic samples for {cfg.model.preset} -> {out / INDEX}", flush=True)
        barrier(rt)
        return out / INDEX
    if p.images is None or p.encoders is None:
        raise DataError("prepare needs prepare.images (--images DIR) and prepare.encoders (--encoders DIR), "
                        "or prepare.synthetic=N")
    missing = missing_parts(p.encoders)
    if missing:
        raise DataError(f"prepare.encoders {p.encoders} lacks {', '.join(missing)}: it must be laid out like a "
                        "diffusers SD3 checkpoint (vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/)")
    start = time.perf_counter()
    pairs = find_pairs(p.images)  # every rank lists the same folder and gets the same sorted list (or error)
    headers = read_headers(rt, pairs)
    units = plan_units(pairs, headers, cfg)
    settings = run_settings(cfg, pairs, headers)
    plan = plan_id(settings)
    scaling, shift = _vae_factors(p.encoders)
    error, removed = None, 0
    if rt.is_main:
        try:
            removed = _claim_folder(out, settings)
        except UserError as e:
            error = str(e)
        except OSError as e:
            error = f"prepare.out {out} cannot be written ({e})"
    raise_on_all(rt, error)  # also the barrier that keeps writers out until the temporaries are gone

    todo = [u for u in units[rt.rank::rt.world] if not _finished(out, u, plan)]
    done_units = [u for u in units if _finished(out, u, plan)] if rt.is_main else []
    done_before = sum(len(u.items) for u in done_units)
    if rt.is_main:
        used = sorted({u.bucket for u in units if u.bucket is not None})
        print(f"[prepare] {len(pairs)} images -> {len(units)} shard(s) of <= {p.shard_size}"
              + (f" in {len(used)} bucket(s) at {cfg.data.resolution}^2 pixels (step {p.bucket_step}): "
                 + ", ".join(f"{w}x{h}: {sum(len(u.items) for u in units if u.bucket == (w, h))}" for w, h in used)
                 if p.buckets else "")
              + f"; {rt.world} rank(s); {len(done_units)} shard(s) ({done_before} images) already done"
              + (f"; removed {removed} unfinished temporary file(s) of a killed run" if removed else ""), flush=True)
    progress = Progress(rt, len(pairs), done_before, rt.world, p.progress_every_s, "prepare")
    if todo:
        enc = load_encoders(p.encoders, rt.device, what="prepare.encoders")
        if rt.is_main:
            print(f"[prepare] encoders loaded in {time.perf_counter() - start:.1f} s (VAE scaling {scaling}, "
                  f"shift {shift})", flush=True)
        for written, unit in enumerate(todo, 1):
            tensors = encode_unit(unit, enc, cfg, rt.device, scaling, shift)
            # One metadata key: safetensors writes a map of several in no fixed order, and the shard bytes must
            # not depend on the run that wrote them.
            save_shard(out / unit.file, tensors, {"plan": plan})
            progress.update(len(unit.items))
            _maybe_kill(cfg, rt, written)
    made_by_rank = all_gather_object(rt, len(todo))  # also the barrier: every rank's shards are on disk
    index = out / INDEX
    if rt.is_main:
        index = _write_index(out, units, plan, cfg, scaling, shift)
        made = sum(len(u.items) for u in units) - done_before
        print(f"[prepare] done: {len(units)} shard(s), {len(pairs)} samples ({made} encoded now; shards made per "
              f"rank: {' '.join(map(str, made_by_rank))}) in {time.perf_counter() - start:.1f} s -> {index}",
              flush=True)
    # Every rank leaves together, as generate's ranks do: a peer tearing the group down early can abort rank 0's
    # gloo threads while it still writes the index.
    barrier(rt)
    return index


def _write_index(out: Path, units: list[Unit], plan: str, cfg: Config, scaling: float, shift: float) -> Path:
    """Rank 0, once every rank is done: the index of exactly the planned shards, each checked to be finished."""
    missing = [u.file for u in units if not _finished(out, u, plan)]
    if missing:
        raise DataError(f"prepare.out {out}: shard(s) {', '.join(missing[:5])} were not written (a rank stopped "
                        "early?); run prepare again to make them")
    entries = []
    for unit in units:
        entry: dict = {"file": unit.file, "samples": len(unit.items)}
        if unit.bucket is not None:
            entry["bucket"] = list(unit.bucket)
        entries.append(entry)
    meta = {"source": str(cfg.prepare.images), "resolution": cfg.data.resolution, "vae_scaling": scaling,
            "vae_shift": shift, "plan": plan}
    if cfg.prepare.buckets:
        meta.update(bucket_step=cfg.prepare.bucket_step, max_aspect=cfg.prepare.max_aspect)
    return write_index(out, entries, meta)
