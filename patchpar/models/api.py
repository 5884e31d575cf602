"""Loaded models as `(apply_fn, params)` pairs. Each apply_fn is a small frozen object that
keeps its Flax module (so the parallel layer can swap the site ops with `with_ops`). The
denoisers come from their families (`patchpar.models.family`); the shared components (VAE,
CLIP, T5) from `patchpar.models.components`."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec, resolve
from patchpar.models.components import (
    T5EncoderFn,
    TextEncoderFn,
    VAEFn,
    abstract_init,
    component,
    load_t5_encoder,
    load_text_encoder,
    load_vae,
    random_params,
    random_params_on_device,
)
from patchpar.models.family import Denoiser, of_folder
from patchpar.models.pixart import PixArtFn, load_pixart
from patchpar.models.unet import UNetFn, load_unet


def load_denoiser(
    path: str | Path, dtype=jnp.float32, attention: AttentionSpec = AUTO
) -> tuple[Denoiser, dict]:
    """The denoiser of a diffusers folder, `(fn, params)`: the denoiser subfolder of a pipeline
    folder (`unet/`, `transformer/`), or such a component folder itself, of whichever family
    it is (`family.of_folder`; an unsupported one is named). Every fn is a `Denoiser`."""
    fam = of_folder(path)
    folder = component(path, fam.denoiser_folder)
    return fam.load_denoiser(folder, dtype, resolve(attention, dtype))


__all__ = [
    "Denoiser", "PixArtFn", "T5EncoderFn", "TextEncoderFn", "UNetFn", "VAEFn", "abstract_init",
    "load_denoiser", "load_pixart", "load_t5_encoder", "load_text_encoder", "load_unet",
    "load_vae", "random_params", "random_params_on_device",
]  # fmt: skip
