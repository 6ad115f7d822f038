"""Preview images while training: a fixed prompt set rendered from the current weights every `preview.every` steps.

The prompts are encoded once at the start (the text encoders are freed right after; the VAE stays), each rank
renders its share (prompt i on rank i mod world, seeds as `generate` draws them), PNGs go to
<output.dir>/previews/step-NNNNNNNN/ and rank 0 adds them to TensorBoard. Under FSDP every forward is a
collective, so every rank runs the same number of batches (a rank with fewer prompts repeats one and
discards it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .components import load_encoders, missing_parts, random_encoders
from .config import Config
from .dist import Runtime, all_gather_object
from .generate import _mix_seed, write_png
from .parallel import unwrap
from .pipeline import Conditioning, SD3Pipeline


def _encoders(cfg: Config, device: torch.device, dtype: torch.dtype):
    folder = cfg.preview.encoders
    if folder is None and cfg.model.pretrained is not None and not missing_parts(cfg.model.pretrained):
        folder = cfg.model.pretrained
    if folder is not None:
        return load_encoders(folder, device, dtype, what="preview.encoders"), str(folder)
    return random_encoders(cfg.model.preset, device=device, dtype=dtype), f"random {cfg.model.preset} encoders"


class Previewer:
    def __init__(self, cfg: Config, rt: Runtime, model: torch.nn.Module, bf16: bool, fsdp: bool):
        p = cfg.preview
        self.cfg, self.rt, self.fsdp = cfg, rt, fsdp
        dtype = torch.bfloat16 if bf16 else torch.float32
        encoders, self.source = _encoders(cfg, rt.device, dtype)
        # DDP's forward would sync buffers; the plain module renders. FSDP's forward is the only way to its weights.
        transformer = model if fsdp else unwrap(model)
        self.pipe = SD3Pipeline(transformer, encoders, rt.device, dtype, training_model=True)
        self.side = cfg.data.resolution
        self.prompts = list(p.prompts)
        guided = p.guidance > 1.0
        self.cond = self.pipe.encode(self.prompts, [""] * len(self.prompts) if guided else None)
        encoders.drop_text_encoders()
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()
        self.mine = list(range(rt.rank, len(self.prompts), rt.world))
        self.rounds = -(-len(self.prompts) // rt.world)  # the most prompts any rank has

    def _cond(self, index: int) -> Conditioning:
        c = self.cond
        pick = slice(index, index + 1)
        neg = (c.negative_embeds[pick], c.negative_pooled[pick]) if c.negative_embeds is not None else (None, None)
        return Conditioning(c.embeds[pick], c.pooled[pick], *neg)

    @torch.no_grad()
    def render(self, step: int, out: Path, tensorboard: Any = None) -> float:
        """Collective: every rank calls it. Returns the seconds it took."""
        p = self.cfg.preview
        start = time.perf_counter()
        folder = out / "previews" / f"step-{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        made: list[tuple[int, np.ndarray]] = []
        for r in range(self.rounds):
            real = r < len(self.mine)
            index = self.mine[r] if real else self.mine[0] if self.mine else 0
            seed = _mix_seed(p.seed, index, 0)
            latents = self.pipe.denoise(self.pipe.initial_noise([seed], self.side, self.side), self._cond(index),
                                        p.steps, p.guidance)
            if not real:
                continue
            image = self.pipe.decode(latents)[0]
            write_png(image, folder / f"{index:03d}.png", {"prompt": self.prompts[index], "seed": seed,
                                                            "step": step, "steps": p.steps, "guidance": p.guidance})
            made.append((index, image))
        gathered = all_gather_object(self.rt, made)
        if self.rt.is_main and tensorboard is not None:
            for index, image in sorted((pair for part in gathered for pair in part), key=lambda x: x[0]):
                tensorboard.add_image(f"preview/{index:03d}", image, step, dataformats="HWC")
            tensorboard.flush()
        return time.perf_counter() - start
