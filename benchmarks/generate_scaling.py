"""How `sd3cluster generate` scales with ranks: the tiny random pipeline on CPU ranks (one thread each), torchrun
with 1, 2 and 4 processes, the same number of images per rank (weak scaling).

    python3 benchmarks/generate_scaling.py --ranks 1,2,4 --images-per-rank 48 --out scaling.json

Per rank: images it wrote / seconds it spent in its batch loop (from the run's summary.json), so the model build
and the rendezvous are left out; the verdict compares the slowest rank of each run with the one-rank run
(target: >= 0.9). The job's own images/s (all images / wall time of the loop) is printed beside it. Run it on a
machine with at least as many free cores as the largest rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run(nproc: int, images: int, args: argparse.Namespace, workdir: Path) -> dict:
    prompts = workdir / f"prompts-{nproc}.txt"
    prompts.write_text("".join(f"a photo of a red house number {i}\n" for i in range(images)))
    out = workdir / f"out-{nproc}"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=127.0.0.1:0", "-m", "sd3cluster", "generate", "--prompts", str(prompts),
           "--out", str(out), "--size", str(args.size), "--steps", str(args.steps), "--batch-size",
           str(args.batch_size), "--guidance", "5", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{nproc} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    per_rank = [r["made"] / r["seconds"] for r in summary["ranks"] if r["seconds"] > 0]
    loop_s = max(r["seconds"] for r in summary["ranks"])
    return {"ranks": nproc, "images": summary["on_disk"], "per_rank_images_per_s": per_rank,
            "slowest_rank_images_per_s": min(per_rank), "job_images_per_s": summary["on_disk"] / loop_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--images-per-rank", type=int, default=48)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (int(n) for n in args.ranks.split(",")):
            results.append(run(nproc, nproc * args.images_per_rank, args, Path(tmp)))
    base = results[0]["slowest_rank_images_per_s"]
    print("ranks  images  slowest rank img/s  ratio to 1 rank  job img/s")
    for r in results:
        r["ratio"] = r["slowest_rank_images_per_s"] / base
        r["passed"] = r["ratio"] >= 0.9
        print(f"{r['ranks']:>5}  {r['images']:>6}  {r['slowest_rank_images_per_s']:>18.2f}  {r['ratio']:>15.3f}  "
              f"{r['job_images_per_s']:>9.2f}  {'PASS' if r['passed'] else 'FAIL'}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
