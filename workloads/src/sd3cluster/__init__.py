"""sd3cluster: distributed Stable Diffusion 3 training, data preparation and cluster verification."""

import logging

__version__ = "0.1.0"

# peft's LoRA injection imports transformers' torchao quantizer, and so torchao, whenever torchao is installed
# (the ao_adamw8bit extra). On import torchao warns about each optional C++ kernel (MX-FP8, CUTLASS sm90a) that
# cannot load without a matching GPU, and torch warns (logger torch.utils._pytree) that torchao registers enums
# the deprecated way. sd3cluster uses none of those kernels and the user can act on neither; the lines buried
# every command's own one-line errors.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
