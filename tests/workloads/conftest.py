"""Fixtures of the workloads tests: tiny random SD3 encoders and a folder of captioned images."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_encoders(tmp_path_factory) -> Path:
    """A random SD3-shaped encoder folder (VAE, CLIP-L, CLIP-G, T5, tokenizers) that fits the `tiny` preset."""
    import torch
    from diffusers import AutoencoderKL
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        PreTrainedTokenizerFast,
        T5Config,
        T5EncoderModel,
    )

    root = tmp_path_factory.mktemp("encoders")
    torch.manual_seed(0)
    words = "a photo of red blue green cat dog tree house sky small big on the in".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    for sub in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        fast.save_pretrained(root / sub)
    for sub in ("text_encoder", "text_encoder_2"):  # CLIP-L and CLIP-G: 8 + 8 wide, pooled 8 + 8 = 16
        cfg = CLIPTextConfig(vocab_size=len(vocab), hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=77, projection_dim=8,
                             pad_token_id=0, eos_token_id=2)
        CLIPTextModelWithProjection(cfg).save_pretrained(root / sub)
    t5 = T5Config(vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                  relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)
    T5EncoderModel(t5).save_pretrained(root / "text_encoder_3")
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                  latent_channels=16, norm_num_groups=4, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609,
                  use_quant_conv=False, use_post_quant_conv=False).save_pretrained(root / "vae")
    return root


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
