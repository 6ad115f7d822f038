"""A rank's input work per micro-step against the cluster's size: noise and timesteps, and the sampler.

    PYTHONPATH=workloads/src python3 benchmarks/sd3_rank_input_scaling.py

Simulates the last rank of a world of 1 and of 512 ranks (64 nodes x 8 GPUs) at SD3-medium's 1024^2 latents
(16x128x128), micro-batch 8, micro-step 1000, and times what `train` does on that rank's host for one micro-step:
its noise and sigmas (flow.sample_noise over its own slice) and its sampler's indices over a 1,000,000-sample
data set. A rank's work must not grow with the world: the ratio 512/1 is printed and must stay below 2.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workloads" / "src"))

from sd3cluster.config import FlowConfig
from sd3cluster.data import DistributedBatchSampler
from sd3cluster.flow import sample_noise

LATENT, MICRO, STEP, SAMPLES = (16, 128, 128), 8, 1000, 1_000_000


def median_s(fn, repeats: int = 7) -> float:
    fn()  # first call: allocations, the sampler's permutation of the epoch
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    flow, rows = FlowConfig(), {}
    for world in (1, 512):
        rank = world - 1
        first = STEP * MICRO * world + rank * MICRO
        noise = median_s(lambda first=first: sample_noise(flow, 0, first, MICRO, LATENT))
        sampler = DistributedBatchSampler(SAMPLES, MICRO * world, rank, world, seed=0)
        sampled = median_s(sampler.next_indices)
        rows[world] = (noise, sampled)
        print(f"world {world:>3}: noise+sigmas of the rank's {MICRO} samples {noise * 1e3:.1f} ms; sampler "
              f"{sampled * 1e3:.3f} ms", flush=True)
    ratio_noise, ratio_sampler = rows[512][0] / rows[1][0], rows[512][1] / rows[1][1]
    print(f"ratio world 512 / world 1: noise {ratio_noise:.2f}, sampler {ratio_sampler:.2f}")
    return 0 if ratio_noise < 2 and ratio_sampler < 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
