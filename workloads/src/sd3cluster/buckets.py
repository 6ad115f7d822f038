"""Aspect-ratio buckets: image sizes of about one pixel budget (resolution^2), so a set of mixed shapes trains
without square crops, and a sampler whose every micro-batch holds one bucket (one tensor shape).

The bucket set of a resolution R, a step s and a largest aspect ratio A: for every width w = s, 2s, ... the
height h = floor(R^2 / w / s) x s, kept when both sides are at least s and max(w/h, h/w) <= A. At R=1024, s=64,
A=4 that is 25 buckets from 512x2048 to 2048x512 (1024x1024 among them), each at most 1024^2 pixels. An image
goes to the bucket whose aspect ratio is nearest its own (in log ratio), is resized to cover it and center-cropped.
"""

from __future__ import annotations

import math

import torch

from .data import ResumableBatchSampler
from .errors import DataError


def bucket_set(resolution: int, step: int = 64, max_aspect: float = 4.0) -> list[tuple[int, int]]:
    """(width, height) pairs, widest-last by aspect ratio."""
    budget = resolution * resolution
    found = set()
    width = step
    while width <= budget // step:
        height = budget // width // step * step
        if height >= step and max(width / height, height / width) <= max_aspect:
            found.add((width, height))
        width += step
    if not found:
        raise DataError(f"no bucket of at most {resolution}^2 pixels with sides multiple of {step}; lower "
                        "prepare.bucket_step or raise the resolution")
    return sorted(found, key=lambda wh: wh[0] / wh[1])


def nearest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    ratio = math.log(width / height)
    return min(buckets, key=lambda wh: (abs(math.log(wh[0] / wh[1]) - ratio), -wh[0] * wh[1]))


def cover_and_crop(width: int, height: int, bucket: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The resized size that covers the bucket, and the (left, top) of the centered crop in it."""
    scale = max(bucket[0] / width, bucket[1] / height)
    resized = (max(bucket[0], round(width * scale)), max(bucket[1], round(height * scale)))
    return resized, ((resized[0] - bucket[0]) // 2, (resized[1] - bucket[1]) // 2)


class BucketBatchSampler(ResumableBatchSampler):
    """Micro-batches of one bucket each. Per epoch: every bucket's samples in a seeded permutation, cut into global
    batches (a bucket's remainder waits for the next epoch's permutation), and the batches of all buckets in a seeded
    order; rank r keeps slice r of each. The state is (epoch, position), like DistributedBatchSampler's."""

    def __init__(self, sample_buckets: list[int], global_batch: int, rank: int, world: int, seed: int = 0,
                 shuffle: bool = True):
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world}")
        self.members: dict[int, list[int]] = {}
        for index, bucket in enumerate(sample_buckets):
            self.members.setdefault(int(bucket), []).append(index)
        self.global_batch, self.rank, self.world, self.seed, self.shuffle = global_batch, rank, world, seed, shuffle
        if self.batches_per_epoch == 0:
            sizes = ", ".join(f"{len(v)}" for v in self.members.values())
            raise DataError(f"no aspect-ratio bucket holds one global batch ({global_batch} = data.batch_size x "
                            f"ranks; bucket sizes {sizes}); add data or lower data.batch_size")
        self.epoch, self.position = 0, 0
        self._plan: list[list[int]] | None = None
        self._plan_epoch = -1

    @property
    def batches_per_epoch(self) -> int:
        return sum(len(v) // self.global_batch for v in self.members.values())

    def _batches(self, epoch: int) -> list[list[int]]:
        if self._plan is None or self._plan_epoch != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            batches = []
            for bucket in sorted(self.members):
                items = self.members[bucket]
                order = torch.randperm(len(items), generator=gen).tolist() if self.shuffle else range(len(items))
                items = [items[i] for i in order]
                batches += [items[i:i + self.global_batch]
                            for i in range(0, len(items) - self.global_batch + 1, self.global_batch)]
            if self.shuffle:
                batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
            self._plan, self._plan_epoch = batches, epoch
        return self._plan

    def _indices(self, epoch: int, position: int) -> tuple[int, int, list[int]]:
        if position >= self.batches_per_epoch:
            epoch, position = epoch + 1, 0
        chunk = self._batches(epoch)[position]
        per_rank = self.global_batch // self.world
        return epoch, position + 1, chunk[self.rank * per_rank:(self.rank + 1) * per_rank]

