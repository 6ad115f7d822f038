"""`sd3cluster generate`: a prompt file -> PNG images and manifest.jsonl, over every rank torchrun starts.

The work is planned the same way on every rank and for every rank count: each (prompt, image) gets its own
seed, items are grouped into batches of one size in file order, and whole batches are dealt to the ranks (or to
rank pairs under CFG parallel). A batch's images therefore do not depend on how many ranks ran it.

Resumable: an image counts as done when its PNG exists; PNGs are written to a temporary name, synced and
renamed, so a killed job leaves no truncated image behind, and a rerun renders only what is missing (a batch
that is partly done is rendered again and only its missing images are written). The run's settings are kept in
generate.json; a rerun into the same folder with other settings is refused with the keys that differ.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .config import Config, GenerateConfig
from .dist import Runtime, all_gather_object, barrier, broadcast_object
from .errors import UserError
from .files import keep_settings, write_file_atomic
from .progress import Progress

SETTINGS = "generate.json"
MANIFEST = "manifest.jsonl"
PROGRESS = "progress.json"
# Keys of a jsonl prompt line.
LINE_KEYS = {"prompt", "negative_prompt", "seed", "width", "height"}


@dataclass(frozen=True)
class WorkItem:
    prompt_index: int
    image_index: int
    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int

    @property
    def name(self) -> str:
        return f"{self.prompt_index:06d}-{self.image_index:03d}.png"


def _mix_seed(base: int, prompt_index: int, image_index: int) -> int:
    """A well-spread 63-bit seed per (base, prompt, image): neighbouring prompts get unrelated noise."""
    digest = hashlib.blake2b(f"{base}:{prompt_index}:{image_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def read_prompts(path: Path | None) -> list[dict[str, Any]]:
    """Prompts of a .txt file (one per non-empty line) or a .jsonl file (one JSON object per line)."""
    if path is None:
        raise UserError("generate needs --prompts FILE (one prompt per line, or JSON lines with a \"prompt\" key)")
    path = Path(path)
    if not path.exists():
        raise UserError(f"prompts file {path} does not exist")
    if not path.is_file():
        raise UserError(f"prompts file {path} is not a file; pass a .txt or .jsonl file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"prompts file {path} cannot be read as UTF-8 text ({e})") from None
    prompts: list[dict[str, Any]] = []
    jsonl = path.suffix.lower() in (".jsonl", ".json")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append({"prompt": line.strip()})
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be an object such as "
                            '{"prompt": "a red house"}') from None
        if not isinstance(entry, dict):
            raise UserError(f"{path}:{number}: a JSON {type(entry).__name__}, not an object; each line must be an "
                            'object such as {"prompt": "a red house"}')
        unknown = sorted(set(entry) - LINE_KEYS)
        if unknown:
            raise UserError(f"{path}:{number}: unknown key(s) {', '.join(unknown)}; "
                            f"allowed: {', '.join(sorted(LINE_KEYS))}")
        if not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
            raise UserError(f"{path}:{number}: \"prompt\" must be a non-empty string")
        if "negative_prompt" in entry and not isinstance(entry["negative_prompt"], str):
            raise UserError(f"{path}:{number}: \"negative_prompt\" must be a string")
        for key in ("seed", "width", "height"):
            value = entry.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise UserError(f"{path}:{number}: \"{key}\" must be a whole number >= 0, got {value!r}")
        for key in ("width", "height"):
            value = entry.get(key)
            if value is not None and (value % 16 or not 16 <= value <= 8192):
                raise UserError(f"{path}:{number}: \"{key}\" {value} must be a multiple of 16 between 16 and 8192")
        prompts.append(entry)
    if not prompts:
        raise UserError(f"prompts file {path} holds no prompts (it is empty or only blank lines)")
    return prompts


def plan_items(prompts: list[dict[str, Any]], g: GenerateConfig) -> list[WorkItem]:
    items = []
    for i, entry in enumerate(prompts):
        for k in range(g.images_per_prompt):
            seed = entry["seed"] + k if entry.get("seed") is not None else _mix_seed(g.seed, i, k)
            items.append(WorkItem(i, k, entry["prompt"], entry.get("negative_prompt", g.negative_prompt), seed,
                                  entry.get("width") or g.width, entry.get("height") or g.height))
    return items


def plan_batches(items: list[WorkItem], batch_size: int) -> list[list[WorkItem]]:
    """Batches of one image size, in the order sizes first appear in the file; the same for every rank count."""
    by_size: dict[tuple[int, int], list[WorkItem]] = {}
    for item in items:
        by_size.setdefault((item.width, item.height), []).append(item)
    return [group[i:i + batch_size] for group in by_size.values() for i in range(0, len(group), batch_size)]


def workers(rt: Runtime, cfg_parallel: bool) -> tuple[int, int]:
    """(this rank's worker index, number of workers): a worker is one rank, or a rank pair under CFG parallel."""
    return (rt.rank // 2, rt.world // 2) if cfg_parallel else (rt.rank, rt.world)


def run_settings(g: GenerateConfig, prompts_sha: str, model: str) -> dict[str, Any]:
    """What decides the images (not how fast they are made): a rerun must match it to continue a folder."""
    return {"prompts_sha256": prompts_sha, "model": model, "steps": g.steps, "guidance": g.guidance,
            "seed": g.seed, "width": g.width, "height": g.height, "negative_prompt": g.negative_prompt,
            "images_per_prompt": g.images_per_prompt, "max_sequence_length": g.max_sequence_length,
            "dtype": g.dtype}


def model_identity(cfg: Config, checkpoint: Path | None) -> str:
    """Names the weights: a checkpoint by its resolved step folder, so a rerun after training saved a newer
    `latest` is told that the weights changed."""
    g = cfg.generate
    lora = f"+lora:{Path(g.lora).resolve()}@{g.lora_scale:g}" if g.lora is not None else ""
    if checkpoint is not None:
        return f"checkpoint:{checkpoint.resolve()}{':ema' if g.ema else ''}{lora}"
    if g.pretrained is not None:
        return f"pretrained:{Path(g.pretrained).resolve()}{lora}"
    return f"random:{cfg.model.preset}{lora}"


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    differ = keep_settings(out / SETTINGS, settings)
    if differ:
        raise UserError(f"{out} holds images made with other settings ({'; '.join(differ)}); pick a new --out "
                        "folder, or rerun with the old settings to finish that set")


def check_out(out: Path | None) -> Path:
    if out is None:
        raise UserError("generate needs --out DIR (the images and manifest.jsonl go there)")
    from .checks import writable_folder

    return writable_folder(Path(out), "--out (generate.out)")


def png_bytes(image: np.ndarray, record: dict[str, Any], compress_level: int = 6) -> bytes:
    """A PNG of a uint8 RGB image; the record (prompt, seed, ...) travels in its `sd3cluster` text chunk."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("sd3cluster", json.dumps(record, sort_keys=True))
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", pnginfo=info, compress_level=compress_level)
    return buffer.getvalue()


def write_png(image: np.ndarray, path: Path, record: dict[str, Any]) -> None:
    write_file_atomic(png_bytes(image, record), path)


def item_record(item: WorkItem, g: GenerateConfig, model: str) -> dict[str, Any]:
    return {"file": f"images/{item.name}", "prompt": item.prompt, "negative_prompt": item.negative_prompt,
            "prompt_index": item.prompt_index, "image_index": item.image_index, "seed": item.seed,
            "steps": g.steps, "guidance": g.guidance, "width": item.width, "height": item.height, "model": model}


def _validate_launch(rt: Runtime, g: GenerateConfig) -> None:
    if g.cfg_parallel:
        if g.guidance <= 1.0:
            raise UserError("--cfg-parallel splits the guided passes over two ranks, but guidance is "
                            f"{g.guidance} (no guidance); drop --cfg-parallel or set guidance above 1")
        if rt.world % 2:
            raise UserError(f"--cfg-parallel pairs the ranks, but there are {rt.world}; start an even number")


def _cfg_pair(rt: Runtime, g: GenerateConfig):
    from .pipeline import CfgPair

    if not g.cfg_parallel:
        return None
    import torch.distributed as dist

    groups = [dist.new_group([2 * p, 2 * p + 1]) for p in range(rt.world // 2)]  # every rank makes every group
    return CfgPair(groups[rt.rank // 2], rt.rank % 2)


def generate(cfg: Config, rt: Runtime) -> dict[str, Any]:
    from .pipeline import check_pretrained, load_pipeline, resolve_dtype

    g = cfg.generate
    _validate_launch(rt, g)
    prompts = read_prompts(g.prompts)
    out = check_out(g.out)
    if g.pretrained is not None:
        check_pretrained(g.pretrained)
    if g.lora is not None:
        from .lora import read_lora

        read_lora(g.lora, "generate.lora")  # not a LoRA, or unreadable: stop before anything is written
    checkpoint = None
    if g.checkpoint is not None:
        from .export import resolve_checkpoint

        # A missing or torn checkpoint stops before anything is written. Rank 0's answer is everyone's: a run that
        # is still training may save a newer one between two ranks' looks.
        checkpoint = Path(str(broadcast_object(rt, str(resolve_checkpoint(g.checkpoint, g.step)))))
    items = plan_items(prompts, g)
    batches = plan_batches(items, g.batch_size)
    model = model_identity(cfg, checkpoint)
    settings = run_settings(g, hashlib.sha256(Path(g.prompts).read_bytes()).hexdigest(), model)
    images_dir = out / "images"
    error = None
    if rt.is_main:
        try:
            images_dir.mkdir(parents=True, exist_ok=True)
            check_settings(out, settings)
            for stale in images_dir.glob(".*.tmp"):  # a killed run's unfinished PNGs; never counted as done
                stale.unlink(missing_ok=True)
        except UserError as e:
            error = str(e)
        except OSError as e:
            error = f"--out {out} cannot be written ({e})"
    error = broadcast_object(rt, error)
    if error:
        raise UserError(error)

    worker, n_workers = workers(rt, g.cfg_parallel)
    mine = batches[worker::n_workers]
    todo = [b for b in mine if any(not (images_dir / item.name).is_file() for item in b)]
    # Rank 0 alone counts what is done for its report; each rank looks only at its own batches above.
    done_before = sum(1 for item in items if (images_dir / item.name).is_file()) if rt.is_main else 0
    if rt.is_main:
        print(f"[generate] {len(prompts)} prompts x {g.images_per_prompt} = {len(items)} images in {len(batches)} "
              f"batches of <= {g.batch_size} over {n_workers} worker(s) ({rt.world} rank(s)"
              f"{', CFG parallel' if g.cfg_parallel else ''}); {done_before} already done", flush=True)
    device = rt.device
    dtype = resolve_dtype(g.dtype, device)
    pair = _cfg_pair(rt, g)
    pipe = load_pipeline(cfg.model.preset, device, dtype, g.pretrained, checkpoint, "latest", g.ema,
                         g.max_sequence_length, g.compile, log=print if rt.is_main else (lambda _: None),
                         lora=g.lora, lora_scale=g.lora_scale)
    progress = Progress(rt, len(items), done_before, n_workers, g.progress_every_s, "generate", out / PROGRESS)
    parts = out / ".parts"
    parts.mkdir(exist_ok=True)
    made, seconds = 0, 0.0
    stage_totals = {"encode": 0.0, "denoise": 0.0, "decode": 0.0}
    writes = pair is None or pair.member == 1
    with open(parts / f"rank-{rt.rank}.jsonl", "a") as times_log:
        for batch in todo:
            start = time.perf_counter()
            first = batch[0]
            images, stage = pipe([i.prompt for i in batch], [i.seed for i in batch], first.height, first.width,
                                 g.steps, g.guidance, [i.negative_prompt for i in batch], pair)
            for key in stage_totals:
                stage_totals[key] += getattr(stage, key)
            written = []
            if writes:
                for item, image in zip(batch, images, strict=True):
                    path = images_dir / item.name
                    if not path.is_file():  # a partly done batch: its finished images stay as they are
                        write_png(image, path, item_record(item, g, model))
                        written.append(item)
            elapsed = time.perf_counter() - start
            seconds += elapsed
            for item in written:
                times_log.write(json.dumps({"file": f"images/{item.name}", "seconds": elapsed / len(batch),
                                            "rank": rt.rank, "time": time.time()}) + "\n")
            times_log.flush()
            made += len(written)
            progress.update(len(batch))
    barrier(rt)
    stats = all_gather_object(rt, {"rank": rt.rank, "made": made, "seconds": seconds, "batches": len(todo),
                                   **stage_totals})
    summary: dict[str, Any] = {}
    if rt.is_main:
        summary = _finish(out, items, g, model, stats, progress)
    # Every rank leaves together: a rank that tore its process group down while rank 0 still wrote the manifest
    # made rank 0's gloo threads abort at exit now and then ("terminate called without an active exception").
    barrier(rt)
    return summary


def _finish(out: Path, items: list[WorkItem], g: GenerateConfig, model: str, stats: list[dict[str, Any]],
            progress: Progress) -> dict[str, Any]:
    """Rank 0, after every rank is done: manifest.jsonl (one line per image on disk, in prompt order) and a summary."""
    times: dict[str, dict[str, Any]] = {}
    for part in sorted((out / ".parts").glob("rank-*.jsonl")):
        for line in part.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line a killed rank did not finish
            times[entry["file"]] = entry
    lines, missing = [], 0
    for item in items:
        record = item_record(item, g, model)
        if not (out / record["file"]).is_file():
            missing += 1
            continue
        timing = times.get(record["file"], {})
        record.update(seconds=timing.get("seconds"), time=timing.get("time"))
        lines.append(json.dumps(record))
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text("\n".join(lines) + ("\n" if lines else ""))
    os.replace(tmp, out / MANIFEST)
    wall = time.perf_counter() - progress.start
    made = sum(s["made"] for s in stats)
    progress.update(0, force=True, finished=True, done=len(lines))
    summary = {"images": len(items), "on_disk": len(lines), "missing": missing, "made_now": made,
               "wall_s": wall, "images_per_s": made / wall if wall > 0 else 0.0, "ranks": stats,
               "manifest": str(out / MANIFEST)}
    print(f"[generate] done: {made} new image(s) in {wall:.1f} s ({summary['images_per_s']:.2f} images/s), "
          f"{len(lines)}/{len(items)} on disk, manifest {out / MANIFEST}", flush=True)
    print("[generate] rank  made  batches  encode_s  denoise_s  decode_s", flush=True)
    for s in stats:
        print(f"[generate] {s['rank']:>4}  {s['made']:>4}  {s['batches']:>7}  {s['encode']:>8.2f}  "
              f"{s['denoise']:>9.2f}  {s['decode']:>8.2f}", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

