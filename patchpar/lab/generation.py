"""What a run generates: one loaded pipeline per model, the (prompt, seed) batches of a
config, their conditioning and initial latents, and every image of a prompt set."""

from __future__ import annotations

import numpy as np

from patchpar.lab.config import RunConfig

_PIPELINES: dict = {}


def get_pipeline(model: str, dtype: str, attention=None, quant: str = "none"):
    """One loaded pipeline per (model, dtype, attention, quant) per process (a sweep loads each
    model once per quant mode). dtype `auto`: see `presets.default_dtype`."""
    import jax.numpy as jnp

    from patchpar.models.attention import AUTO
    from patchpar.models.presets import resolve_dtype
    from patchpar.pipelines import load_pipeline

    dtype = resolve_dtype(dtype, model)
    key = (model, dtype, attention or AUTO, quant)
    if key not in _PIPELINES:
        _PIPELINES[key] = load_pipeline(model, getattr(jnp, dtype), attention or AUTO, quant)
    return _PIPELINES[key]


def image_size(pipe, config: RunConfig) -> tuple[int, int]:
    """(height, width) of an image, or of a video model's frame, in pixels."""
    s = config.sampler
    if getattr(pipe, "makes_video", False):
        return pipe.default_size(s.height, s.width)
    h = s.height or pipe.unet.config.sample_size * pipe.latent_factor
    return h, s.width or h


def at_run(pipe, config: RunConfig, plan, hw: tuple[int, int]):
    """A video model's pipeline making the run's videos: sampler.frames (unset: the model's
    own) of `hw` laid out by mesh.layout, checked against `plan`'s row patches (None: one
    device); an image pipeline as it is."""
    if not getattr(pipe, "makes_video", False):
        return pipe
    frames = config.sampler.frames or pipe.unet.default_frames
    return pipe.at(frames, config.mesh.layout, *hw, plan)


def final_latents(pipe, final) -> np.ndarray:
    """A call's final latents as float32: a video's (B, F, h, w, C), whatever its layout."""
    if getattr(pipe, "makes_video", False):
        final = pipe.from_tall(final)
    return np.asarray(final, np.float32)


def batches(config: RunConfig) -> list[list[tuple[str, int]]]:
    """(prompt, seed) pairs, seed-major, cut into pipeline calls."""
    pairs = [(p, s) for s in config.prompts.seeds for p in config.prompts.prompts]
    n = config.prompts.batch_size or len(pairs)
    return [pairs[i : i + n] for i in range(0, len(pairs), n)]


def inputs(pipe, config: RunConfig, batch: list[tuple[str, int]], hw: tuple[int, int]):
    """Conditioning and initial latents (image (p, s) starts from normal(key(s)))."""
    import jax.numpy as jnp

    from patchpar.pipelines.checks import check_finite_conditioning

    s = config.sampler
    prompts = [p for p, _ in batch]
    negative = (
        [config.prompts.negative_prompt] * len(batch) if config.prompts.negative_prompt else None
    )
    cond = pipe.encode_prompt(prompts, negative, s.guidance_scale, *hw)
    check_finite_conditioning(cond, pipe.unet.module.dtype)  # once, before any timed call
    latents = jnp.concatenate([pipe.initial_latents(1, *hw, seed) for _, seed in batch])
    return cond, latents


def generate_all(pipe, config: RunConfig, plan, hw) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, H, W, 3) uint8, or videos (N, T, H, W, 3), and final latents for every
    (prompt, seed), no timing."""
    images, latents = [], []
    s = config.sampler
    pipe = at_run(pipe, config, plan, hw)
    for batch in batches(config):
        cond, x = inputs(pipe, config, batch, hw)
        final = pipe.denoise(cond, x, s.name, s.steps, s.guidance_scale, plan)
        images.append(pipe.decode(final))
        latents.append(final_latents(pipe, final))
    return np.concatenate(images), np.concatenate(latents)
