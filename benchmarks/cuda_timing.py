"""The one GPU timer of the benchmark scripts: the mean time of a callable over CUDA events, after a warm-up."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], iters: int = 10, warmup: int = 3) -> float:
    """Seconds per call of `fn`, averaged over `iters` calls queued back to back (the host does not wait between
    them), after `warmup` calls that take compilation and first-use costs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters
