"""The pipeline's checks of its inputs and outputs: an image size against the networks, a seed,
a guidance scale with its negative prompt (ValueError naming the value and what fits), and NaN
or Inf in the text encoders' output (NonFiniteError)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from patchpar.sampling.guidance import Conditioning


class NonFiniteError(FloatingPointError):
    """NaN or Inf where a result should be (text embeddings, a latent, decoded pixels): the run
    stops there, naming where they first appeared, and its record is an error."""


def check_finite_conditioning(cond: Conditioning, dtype) -> None:
    """NonFiniteError naming the text encoders' output that holds NaN or Inf."""
    for name, a in [("text embeddings", cond.context), *cond.extras.items()]:
        a = np.asarray(a)
        if a.dtype.kind in "fV" and not np.isfinite(a.astype(np.float32)).all():
            raise NonFiniteError(
                f"the {name} of the prompts hold NaN or Inf (text encoding, "
                f"{jnp.dtype(dtype).name}): no image of them is a result"
            )


SEED_RANGE = 2**32  # jax.random.key takes the seed modulo 2^32: a larger one repeats a smaller


def check_image_size(
    unet, factor: int, height: int, width: int, rows_multiple: int = 1
) -> tuple[int, int]:
    """Latent (h, w) of an image size for a denoiser (its config is enough: no weights) under
    a VAE of `factor` pixels per latent pixel; ValueError naming the nearest sizes that fit."""
    down = unet.row_multiple
    for name, v, mult in (
        ("height", height, factor * down * rows_multiple),
        ("width", width, factor * down),
    ):
        if not isinstance(v, int) or v <= 0 or v % mult:
            fit = (
                sorted({max(mult, v // mult * mult), (v // mult + 1) * mult})
                if isinstance(v, int) and v > 0
                else [mult]
            )
            raise ValueError(
                f"{name}={v!r} must be a positive multiple of {mult} (VAE factor {factor} x "
                f"{down} for the {unet.row_multiple_reason}"
                + (f" x {rows_multiple} row patches" if rows_multiple > 1 else "")
                + f"); nearest that fit: {fit}"
            )
    return height // factor, width // factor


def check_seed(seed) -> None:
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int | np.integer)
        or not 0 <= seed < SEED_RANGE
    ):
        raise ValueError(
            f"seed={seed!r}: must be an integer in [0, 2^32) (larger seeds wrap around: "
            f"2^32 would give seed 0's image)"
        )


def check_guidance(guidance_scale, negative_prompts: list[str] | None = None) -> None:
    """A finite scale >= 0 (<= 1: no guidance); a negative prompt needs guidance (> 1), which is
    the only place it acts."""
    if (
        not isinstance(guidance_scale, int | float)
        or not math.isfinite(guidance_scale)
        or guidance_scale < 0
    ):
        raise ValueError(
            f"guidance_scale={guidance_scale!r}: must be a finite number >= 0 (<= 1 turns "
            "guidance off)"
        )
    if any(negative_prompts or []) and guidance_scale <= 1:
        raise ValueError(
            f"a negative prompt with guidance_scale={guidance_scale}: guidance <= 1 is off, so "
            "the negative prompt would be dropped; set guidance_scale > 1 or no negative prompt"
        )
