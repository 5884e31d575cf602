"""Flax Stable Diffusion models (UNet, VAE, CLIP text encoders) and their loading."""

from patchpar.models.api import (
    TextEncoderFn,
    UNetFn,
    VAEFn,
    load_text_encoder,
    load_unet,
    load_vae,
)
from patchpar.models.loading import CheckpointError
from patchpar.models.sites import IDENTITY, SiteOps

__all__ = [
    "IDENTITY",
    "CheckpointError",
    "SiteOps",
    "TextEncoderFn",
    "UNetFn",
    "VAEFn",
    "load_text_encoder",
    "load_unet",
    "load_vae",
]
