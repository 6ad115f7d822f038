"""Fixtures of the workloads tests: tiny random SD3 encoders and a folder of captioned images."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels (sd3cluster.fused_norm) run under Triton's interpreter. Triton reads the switch when
# it is first imported, so it is set here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_encoders(tmp_path_factory) -> Path:
    """A random SD3-shaped encoder folder (VAE, CLIP-L, CLIP-G, T5, tokenizers) that fits the `tiny` preset."""
    from sd3cluster.components import random_encoders, save_encoders

    return save_encoders(random_encoders("tiny"), tmp_path_factory.mktemp("encoders"))


@pytest.fixture
def image_folder(tmp_path) -> Path:
    import numpy as np
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    captions = ["a photo of a red cat", "a big blue house", "a small green tree in the sky", "a dog on a house"]
    for i, caption in enumerate(captions):
        size = (32, 32) if i % 2 == 0 else (48, 40)
        Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(caption + "\n")
    return folder
