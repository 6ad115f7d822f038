"""sd3cluster: distributed Stable Diffusion 3 training, data preparation and cluster verification."""

__version__ = "0.1.0"
