"""SD3's non-transformer parts: VAE, CLIP-L, CLIP-G and T5 with their tokenizers, and SD3's text conditioning.

They come from a local folder laid out as a diffusers SD3 checkpoint (vae/, text_encoder{,_2,_3}/,
tokenizer{,_2,_3}/), or, for tests and benchmarks, are made in code with random weights at the preset's sizes
(tokenizers included), since no weights can be downloaded. Nothing here downloads anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .errors import UserError
from .models import PRESETS

# Prompts are few per batch, and every GPU has its own process: the tokenizers' thread pool buys nothing, and
# with it a torchrun rank of `generate` now and then aborted at exit ("terminate called without an active
# exception": 2 of 24 three-rank runs on CPU, 0 of 40 without it). Read by the tokenizers library when it is used.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENCODER_PARTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3")
CLIP_TOKENS = 77

# Sizes of the random encoders per preset family. `tiny` fits the tiny transformer (CLIP 8 + 8 wide padded to
# T5's 32 = joint_attention_dim; pooled 8 + 8 = 16); `full` is SD3's: CLIP-L/14, OpenCLIP bigG/14, T5-XXL and
# the 16-channel VAE, so a benchmark pays what the published model costs.
_RANDOM_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        clip_l=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, projection_dim=8),
        clip_g=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, projection_dim=8),
        t5=dict(d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8),
        vae=dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, sample_size=32),
        clip_vocab=None, t5_vocab=None),
    "full": dict(
        clip_l=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    projection_dim=768, hidden_act="quick_gelu"),
        clip_g=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                    projection_dim=1280, hidden_act="gelu"),
        t5=dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
                feed_forward_proj="gated-gelu"),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, sample_size=1024),
        clip_vocab=49408, t5_vocab=32128),
}
_WORDS = ("a photo of an the red blue green yellow white black cat dog tree house sky car city river mountain "
          "small big on in at with under over painting drawing portrait landscape night day snow sun").split()


@dataclass
class Encoders:
    vae: torch.nn.Module
    clip_l: torch.nn.Module
    clip_g: torch.nn.Module
    t5: torch.nn.Module
    tok_l: Any
    tok_g: Any
    tok_t5: Any

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Encoders:
        for model in (self.vae, self.clip_l, self.clip_g, self.t5):
            model.to(device=device, dtype=dtype)
        return self

    def drop_text_encoders(self) -> None:
        """Free the text encoders once every embedding a job needs is computed (T5-XXL alone is 9.5 GB in bf16)."""
        self.clip_l = self.clip_g = self.t5 = None


def missing_parts(folder: Path) -> list[str]:
    return [p for p in ENCODER_PARTS if not (Path(folder) / p).is_dir()]


def load_encoders(folder: Path, device: torch.device, dtype: torch.dtype | None = None, what: str = "encoders",
                  ) -> Encoders:
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    folder = Path(folder)
    missing = missing_parts(folder)
    if missing:
        raise UserError(f"{what} {folder} lacks {', '.join(missing)}: it must be laid out like a diffusers SD3 "
                        "checkpoint (vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/)")

    def load(cls, sub):
        # diffusers and transformers name the dtype argument differently.
        kwargs = {} if dtype is None else {"torch_dtype" if cls is AutoencoderKL else "dtype": dtype}
        model = cls.from_pretrained(folder / sub, local_files_only=True, **kwargs)
        return model.to(device).eval().requires_grad_(False)

    try:
        return Encoders(load(AutoencoderKL, "vae"), load(CLIPTextModelWithProjection, "text_encoder"),
                        load(CLIPTextModelWithProjection, "text_encoder_2"), load(T5EncoderModel, "text_encoder_3"),
                        *(AutoTokenizer.from_pretrained(folder / t, local_files_only=True)
                          for t in ("tokenizer", "tokenizer_2", "tokenizer_3")))
    except (OSError, ValueError) as e:
        raise UserError(f"{what} {folder}: a part cannot be loaded ({str(e).splitlines()[0][:300]}); check that "
                        "the folder is a complete diffusers SD3 checkpoint") from None


def _tokenizer(vocab_size: int | None, max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(_WORDS)}}
    if vocab_size is not None and vocab_size < len(vocab):
        raise ValueError(f"vocabulary of {vocab_size} is smaller than the {len(vocab)} words made in code")
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]",
                                   model_max_length=max_length)


def random_encoders(preset: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> Encoders:
    """Random-weight encoders shaped for `preset` (seeded: every rank and every run builds the same ones)."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    if preset not in PRESETS:
        raise UserError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    sizes = _RANDOM_SIZES["tiny" if preset == "tiny" else "full"]
    words = len(_WORDS) + 3
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        clips = []
        for key in ("clip_l", "clip_g"):
            cfg = CLIPTextConfig(vocab_size=sizes["clip_vocab"] or words, max_position_embeddings=CLIP_TOKENS,
                                 pad_token_id=0, bos_token_id=0, eos_token_id=2, **sizes[key])
            clips.append(CLIPTextModelWithProjection._from_config(cfg, dtype=dtype))
        t5cfg = T5Config(vocab_size=sizes["t5_vocab"] or words, decoder_start_token_id=0, pad_token_id=0, **sizes["t5"])
        t5 = T5EncoderModel._from_config(t5cfg, dtype=dtype)
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16, scaling_factor=1.5305,
                            shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
                            **sizes["vae"]).to(dtype)
    models = [m.eval().requires_grad_(False) for m in (vae, *clips, t5)]
    return Encoders(*models, _tokenizer(sizes["clip_vocab"], CLIP_TOKENS), _tokenizer(sizes["clip_vocab"], CLIP_TOKENS),
                    _tokenizer(sizes["t5_vocab"], 512))


def save_encoders(enc: Encoders, folder: Path) -> Path:
    """Write the parts as a diffusers SD3 folder (what `prepare --encoders` and `--pretrained` read)."""
    folder = Path(folder)
    for sub, part in (("vae", enc.vae), ("text_encoder", enc.clip_l), ("text_encoder_2", enc.clip_g),
                      ("text_encoder_3", enc.t5), ("tokenizer", enc.tok_l), ("tokenizer_2", enc.tok_g),
                      ("tokenizer_3", enc.tok_t5)):
        part.save_pretrained(folder / sub)
    return folder


def _ids(tokenizer, prompts: list[str], length: int, device: torch.device) -> torch.Tensor:
    return tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                     return_tensors="pt").input_ids.to(device)


@torch.no_grad()
def encode_prompts(enc: Encoders, prompts: list[str], clip_tokens: int, t5_tokens: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3's conditioning: CLIP penultimate states (L ++ G, zero-padded to T5's width) ++ T5 states along the
    sequence; pooled = CLIP-L and CLIP-G projections side by side (as diffusers' StableDiffusion3Pipeline)."""
    states, pooled = [], []
    for model, tok in ((enc.clip_l, enc.tok_l), (enc.clip_g, enc.tok_g)):
        out = model(_ids(tok, prompts, clip_tokens, device), output_hidden_states=True)
        states.append(out.hidden_states[-2])
        pooled.append(out.text_embeds)
    clip = torch.cat(states, dim=-1)
    t5 = enc.t5(_ids(enc.tok_t5, prompts, t5_tokens, device))[0]
    if clip.shape[-1] > t5.shape[-1]:
        raise UserError(f"CLIP widths ({clip.shape[-1]}) exceed T5's ({t5.shape[-1]}); these encoders do not match")
    clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5.to(clip.dtype)], dim=-2), torch.cat(pooled, dim=-1)
