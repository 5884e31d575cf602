"""Flax diffusion models and their loading from diffusers / transformers folders: the model
families as plug-in packages (`unet`: SD / SDXL, `pixart`: PixArt-α/Σ; `family` is their
registry) and the components they share (the VAE, CLIP and T5 text encoders)."""

from patchpar.models.api import (
    Denoiser,
    PixArtFn,
    T5EncoderFn,
    TextEncoderFn,
    UNetFn,
    VAEFn,
    load_denoiser,
    load_pixart,
    load_t5_encoder,
    load_text_encoder,
    load_unet,
    load_vae,
)
from patchpar.models.loading import CheckpointError
from patchpar.models.sites import IDENTITY, SiteOps

__all__ = [
    "IDENTITY",
    "Denoiser",
    "CheckpointError",
    "PixArtFn",
    "SiteOps",
    "T5EncoderFn",
    "TextEncoderFn",
    "UNetFn",
    "VAEFn",
    "load_denoiser",
    "load_pixart",
    "load_t5_encoder",
    "load_text_encoder",
    "load_unet",
    "load_vae",
]
