"""The eager copies of a warm SD3 training step: which aten copy ops run, on which shapes, and their GPU time.

Inductor's own kernels are `triton_*`; a same-dtype copy launched outside them (`.contiguous()`, `clone`, `copy_`
of a custom op's input or of a gradient between compiled blocks) shows up in a kernel trace only as an anonymous
`elementwise_kernel`. This traces one warm step of `sd3cluster train`'s Trainer with the CPU ops recorded and lists
the copy ops by input shape, so a stream-sized copy ((batch, tokens, channels) or (tokens, batch, channels)) can be
told from the small per-sample ones. Run 14 found this way the stream-sized copies at the edges of the
sequence-first blocks, which chaining the blocks is built to remove (benchmarks/sd3_training.md).

    python3 benchmarks/sd3_step_copies.py sd3-medium:1024:8:optimized [sd3-medium:1024:8:optimized:layout=batch]

Each case is PRESET:RES:BATCH:VARIANT as in sd3_throughput.py; needs a CUDA device.
"""

from __future__ import annotations

import sys

import torch

COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")


def copies_of_one_step(case: str, warmup: int = 3) -> list[tuple[str, int, float, str]]:
    """(op, calls, GPU ms under it, input shapes) of the copy ops of one warm step, largest GPU time first."""
    from sd3cluster.bench import Variant
    from sd3cluster.config import load_config
    from sd3cluster.dist import Runtime
    from sd3cluster.train import Trainer
    from torch.profiler import ProfilerActivity, profile

    preset, res, batch, spec = case.split(":", 3)
    device = torch.device("cuda", 0)
    base = load_config(overrides=[f"model.preset={preset}", f"data.resolution={res}", f"data.batch_size={batch}",
                                  "train.device=cuda"])
    cfg = Variant.parse(spec).config(base, {"data.synthetic_samples": int(batch) * (warmup + 2), "data.path": None,
                                            "checkpoint.dir": None})
    trainer = Trainer(cfg, Runtime(rank=0, world=1, local_rank=0, device=device, distributed=False))
    try:
        print(f"[{case}] {trainer.kernel_note}", flush=True)
        for _ in range(warmup):
            trainer.step_async()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            trainer.step_async()
            torch.cuda.synchronize(device)
    finally:
        trainer.close()
    rows = [(e.key, e.count, e.device_time_total / 1e3, str(e.input_shapes))
            for e in prof.key_averages(group_by_input_shape=True) if e.key in COPY_OPS]
    return sorted(rows, key=lambda row: -row[2])


def main() -> int:
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        print(__doc__.strip(), file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    for case in sys.argv[1:]:
        rows = copies_of_one_step(case)
        print(f"[{case}] copy ops of one step: {sum(r[1] for r in rows)} calls")
        for op, calls, ms, shapes in rows[:12]:
            print(f"  {op:18} x{calls:<4} {ms:7.2f} ms (GPU, the op's kernels) shapes {shapes[:120]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
