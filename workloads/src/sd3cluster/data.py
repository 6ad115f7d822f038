"""Shards of VAE latents and text embeddings, a synthetic source, and a resumable distributed batch sampler."""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from .errors import DataError
from .files import write_file_atomic

INDEX = "index.json"
KEYS = ("latents", "prompt_embeds", "pooled")


@dataclass
class Batch:
    latents: torch.Tensor
    prompt_embeds: torch.Tensor
    pooled: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in (self.latents, self.prompt_embeds, self.pooled)))

    def pin_memory(self) -> Batch:
        return Batch(*(t.pin_memory() for t in (self.latents, self.prompt_embeds, self.pooled)))


class ReadAhead:
    """Runs `load(key)` for the next key on a worker thread while the caller works on the current one.

    The training loop reads micro-batch n+1 (shard reads, noise, pinned host memory) while micro-batch n runs on
    the device, so the GPU does not wait for the host between steps. `load` must be a pure function of its key:
    then reading ahead changes nothing, and a key that is not the one read ahead (after a resume, say) is simply
    loaded on the spot. One worker thread does every load, so a dataset's open files see one thread only.
    """

    def __init__(self, load: Callable[[Hashable], Any]):
        self.load = load
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sd3cluster-data")
        self.ahead: tuple[Hashable, Future] | None = None

    def take(self, key: Hashable, next_key: Hashable | None = None) -> Any:
        if self.ahead is not None and self.ahead[0] == key:
            future = self.ahead[1]
        else:
            future = self.pool.submit(self.load, key)
        self.ahead = (next_key, self.pool.submit(self.load, next_key)) if next_key is not None else None
        return future.result()  # a failed read raises here, in the loop, with its own message

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.ahead = None


class ShardWriter:
    """Writes samples into numbered safetensors shards and, on close, the index that makes them a dataset.

    With buckets (`add(..., bucket=(w, h))`) every shard holds one bucket's samples, recorded in its index entry;
    extra per-sample tensors (original size, crop) are stored beside the three keys the trainer reads."""

    def __init__(self, out: Path, shard_size: int = 256, meta: dict | None = None):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.meta = dict(meta or {})
        self.pending: dict[tuple[int, int] | None, dict[str, list[torch.Tensor]]] = {}
        self.shards: list[dict] = []

    def add(self, latents: torch.Tensor, prompt_embeds: torch.Tensor, pooled: torch.Tensor,
            bucket: tuple[int, int] | None = None, extra: dict[str, torch.Tensor] | None = None) -> None:
        pending = self.pending.setdefault(bucket, {})
        tensors = dict(zip(KEYS, (latents, prompt_embeds, pooled), strict=True))
        for key, t in {**tensors, **(extra or {})}.items():
            pending.setdefault(key, []).extend(t.detach().cpu().unbind(0) if key not in KEYS else
                                               t.detach().cpu().float().unbind(0))
        while len(self.pending[bucket]["latents"]) >= self.shard_size:
            self._flush(bucket, self.shard_size)

    def _flush(self, bucket: tuple[int, int] | None, n: int) -> None:
        pending = self.pending.get(bucket)
        if not n or not pending:
            return
        tensors = {k: torch.stack(v[:n]).contiguous() for k, v in pending.items()}
        self.pending[bucket] = {k: v[n:] for k, v in pending.items()}
        name = shard_name(len(self.shards))
        save_shard(self.out / name, tensors)
        entry: dict[str, Any] = {"file": name, "samples": n}
        if bucket is not None:
            entry["bucket"] = list(bucket)
        self.shards.append(entry)

    def close(self) -> Path:
        for bucket in sorted(self.pending, key=lambda b: b or (0, 0)):
            self._flush(bucket, len(self.pending[bucket].get("latents", [])))
        return write_index(self.out, self.shards, self.meta)


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def save_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """One shard, atomically: a killed writer leaves a hidden temporary file, never a truncated shard."""
    write_file_atomic(save({k: t.contiguous() for k, t in tensors.items()}, metadata=metadata), path)


def shard_metadata(path: Path) -> dict[str, str] | None:
    """The string metadata a shard was saved with; None when the file is missing or not a readable shard."""
    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except (OSError, SafetensorError):
        return None


def write_index(out: Path, shards: list[dict], meta: dict) -> Path:
    """index.json of `shards` (written last, atomically: a folder without it is not a dataset)."""
    if not shards:
        raise DataError(f"no samples were written to {out}")
    with safe_open(str(out / shards[0]["file"]), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()[1:]) for k in KEYS}
    index = {"shards": shards, "samples": sum(s["samples"] for s in shards), "shapes": shapes, **meta}
    buckets = sorted({tuple(s["bucket"]) for s in shards if "bucket" in s})
    if buckets:
        index["buckets"] = [list(b) for b in buckets]
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    tmp.replace(out / INDEX)
    return out / INDEX


class ShardDataset:
    """Samples of the shards in a folder, read lazily (one open file per shard)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index_path = self.folder / INDEX
        if not self.folder.exists():
            raise DataError(f"data.path {self.folder} does not exist; run `sd3cluster prepare` to make shards there "
                            "or set data.synthetic_samples for synthetic data")
        if not self.folder.is_dir():
            raise DataError(f"data.path {self.folder} is a file, not a folder; give the folder `sd3cluster prepare` "
                            f"wrote (the one holding {INDEX})")
        if not index_path.is_file():
            raise DataError(f"data.path {self.folder} holds no {INDEX}: it is not a folder written by "
                            "`sd3cluster prepare` (or that run did not finish); run prepare again")
        try:
            self.index = json.loads(index_path.read_text())
            self.shards = self.index["shards"]
            self.shapes = {k: tuple(v) for k, v in self.index["shapes"].items()}
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{index_path} is damaged ({e}); run `sd3cluster prepare` again") from None
        self.starts = [0]
        self._handles: dict[int, object] = {}
        for number, shard in enumerate(self.shards):
            if not (self.folder / shard["file"]).is_file():
                raise DataError(f"shard {self.folder / shard['file']} listed in {index_path} is missing")
            self.starts.append(self.starts[-1] + shard["samples"])
            # Opening reads and checks the header (and that the file is as long as it says): a damaged shard
            # stops the run here, before anything is written, not at the step that first reads it. Closed again:
            # a big dataset's shards are opened as the epoch reaches them, not all at once.
            with self._open(number):
                pass

    def _damaged(self, shard: int, problem: str) -> DataError:
        path = self.folder / self.shards[shard]["file"]
        return DataError(f"shard {path} is damaged ({problem}); run `sd3cluster prepare` again into a new folder, "
                         f"or restore that file")

    def __len__(self) -> int:
        return self.starts[-1]

    def sample_buckets(self) -> list[int] | None:
        """Each sample's bucket number (its place in the index's bucket list); None for data without buckets."""
        if "buckets" not in self.index:
            return None
        number = {tuple(b): i for i, b in enumerate(self.index["buckets"])}
        out: list[int] = []
        for shard in self.shards:
            out += [number[tuple(shard["bucket"])]] * shard["samples"]
        return out

    def _open(self, shard: int):
        """The shard's safetensors handle, after checking it holds the keys and samples the index lists."""
        try:
            handle = safe_open(str(self.folder / self.shards[shard]["file"]), "pt")
            sizes = {k: handle.get_slice(k).get_shape() for k in KEYS}
        except Exception as e:  # safetensors' own error type names neither the file nor the fix
            raise self._damaged(shard, str(e).splitlines()[0][:200] if str(e) else type(e).__name__) from None
        if any(not size or size[0] < self.shards[shard]["samples"] for size in sizes.values()):
            raise self._damaged(shard, f"it holds fewer samples than the {self.shards[shard]['samples']} {INDEX} "
                                "lists")
        return handle

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = self._open(shard)
        return self._handles[shard]

    def get(self, indices: list[int]) -> Batch:
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in KEYS}
        for i in indices:
            shard = bisect.bisect_right(self.starts, i) - 1
            local = i - self.starts[shard]
            f = self._handle(shard)
            try:
                for k in KEYS:
                    parts[k].append(f.get_slice(k)[local:local + 1])
            except Exception as e:
                raise self._damaged(shard, f"sample {local}: {str(e).splitlines()[0][:200]}") from None
        return Batch(*(torch.cat(parts[k]) for k in KEYS))


class SyntheticDataset:
    """Deterministic random samples (a function of seed and index): benchmarks and tests without data."""

    def __init__(self, samples: int, latent_shape: tuple[int, ...], text_tokens: int, joint_dim: int,
                 pooled_dim: int, seed: int = 0):
        self.samples = samples
        self.shapes = {"latents": tuple(latent_shape), "prompt_embeds": (text_tokens, joint_dim),
                       "pooled": (pooled_dim,)}
        self.seed = seed

    def __len__(self) -> int:
        return self.samples

    def get(self, indices: list[int]) -> Batch:
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in KEYS}
        for i in indices:
            gen = torch.Generator().manual_seed(self.seed * 7_919 + i)
            for k in KEYS:
                parts[k].append(torch.randn((1, *self.shapes[k]), generator=gen))
        return Batch(*(torch.cat(parts[k]) for k in KEYS))


def write_synthetic_shards(out: Path, samples: int, latent_shape: tuple[int, ...], text_tokens: int,
                           joint_dim: int, pooled_dim: int, shard_size: int = 256, seed: int = 0) -> Path:
    source = SyntheticDataset(samples, latent_shape, text_tokens, joint_dim, pooled_dim, seed)
    writer = ShardWriter(out, shard_size, meta={"source": "synthetic", "seed": seed})
    for start in range(0, samples, shard_size):
        b = source.get(list(range(start, min(samples, start + shard_size))))
        writer.add(b.latents, b.prompt_embeds, b.pooled)
    return writer.close()


class ResumableBatchSampler:
    """The cursor of a batch sampler: (epoch, position) is its whole state, saved in checkpoints and restored
    exactly. A subclass says which indices a cursor gives: _indices(epoch, position) -> (epoch, position, indices)
    of the next micro-step."""

    epoch: int
    position: int

    def _indices(self, epoch: int, position: int) -> tuple[int, int, list[int]]:
        raise NotImplementedError

    def next_indices(self) -> list[int]:
        self.epoch, self.position, indices = self._indices(self.epoch, self.position)
        return indices

    def peek_indices(self) -> list[int]:
        """What next_indices() will return, without moving: the data loader reads it ahead."""
        return self._indices(self.epoch, self.position)[2]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class DistributedBatchSampler(ResumableBatchSampler):
    """Each micro-step takes the next `global_batch` indices of a seeded per-epoch permutation; rank r keeps
    slice r. The whole state is (epoch, position): saved in checkpoints, restored exactly."""

    def __init__(self, samples: int, global_batch: int, rank: int, world: int, seed: int = 0, shuffle: bool = True):
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world}")
        if samples < global_batch:
            raise DataError(f"the dataset has {samples} samples, fewer than one global batch ({global_batch} = "
                            "data.batch_size x ranks); add data or lower data.batch_size")
        self.samples, self.global_batch, self.rank, self.world, self.seed = samples, global_batch, rank, world, seed
        self.shuffle = shuffle
        self.epoch, self.position = 0, 0
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    @property
    def batches_per_epoch(self) -> int:
        return self.samples // self.global_batch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm_epoch != epoch:
            self._perm = torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed + epoch)) \
                if self.shuffle else torch.arange(self.samples)
            self._perm_epoch = epoch
        return self._perm

    def _indices(self, epoch: int, position: int) -> tuple[int, int, list[int]]:
        """(epoch, position) of the micro-step after this one, and this rank's indices of this one."""
        if position >= self.batches_per_epoch:
            epoch, position = epoch + 1, 0
        start = position * self.global_batch
        chunk = self._permutation(epoch)[start:start + self.global_batch]
        per_rank = self.global_batch // self.world
        return epoch, position + 1, chunk[self.rank * per_rank:(self.rank + 1) * per_rank].tolist()

