"""Text-to-video (Wan): prompts -> umT5 states -> the denoising loop over a video latent laid out
as a tall image (`patchpar.models.wan.model.Video`: patches over frames, rows or a frame x row
grid) -> the video VAE's decode -> uint8 frames, as diffusers' WanPipeline makes them. The
denoising is the image pipeline's (`text2img.Pipeline`) on the tall latent: every strategy and
step cache runs on it unchanged."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models.video import on_video
from patchpar.models.wan.model import Video
from patchpar.parallel.engine import Plan
from patchpar.parallel.mesh import to_local
from patchpar.parallel.vae import VAEPlan, check_video_plan, decode_video
from patchpar.pipelines.checks import NonFiniteError, check_image_size, check_seed
from patchpar.pipelines.text2img import Pipeline


@dataclass
class VideoOutput:
    frames: np.ndarray  # (B, T, H, W, 3) uint8
    latents: np.ndarray  # (B, F, h, w, C) the final latent, float32
    stale_bytes_per_device: int = 0  # the strategy's stale buffers per device (0: none)
    cache: dict | None = None  # a step cache's report (None: none)
    stages: dict | None = None  # seconds per stage (`Pipeline.__call__`)

    @property
    def images(self) -> np.ndarray:
        """Every frame as an image, (B x T, H, W, 3)."""
        return self.frames.reshape(-1, *self.frames.shape[2:])


@dataclass
class VideoPipeline(Pipeline):
    """A text-to-video pipeline: `Pipeline` whose denoiser (`unet`) is a video model on its
    `Video` layout and whose VAE decodes video (`WanVAEFn`)."""

    makes_video = True

    def at(
        self,
        frames: int,
        layout: str = "frames",
        height: int | None = None,
        width: int | None = None,
        plan: Plan | None = None,
    ) -> VideoPipeline:
        """This pipeline making videos of `frames` frames, the latent laid out by `layout`,
        checked against a frame of `height` x `width` (default the model's) cut into `plan`'s
        row patches; the placed weights' cache shared with this one. A warning where the
        transformer's config names the clip lengths it was trained on (`trained_frames`) and
        `frames` is not one of them."""
        h, w = self.frame_size(*self.default_size(height, width))
        trained = self.unet.config.extra.get("trained_frames")
        if trained and frames not in trained:
            warnings.warn(
                f"frames={frames}: this model was trained on clips of {sorted(trained)} frames "
                f"only; a clip of another length is outside what it learnt",
                stacklevel=2,
            )
        patches = plan.patch if plan is not None and plan.splits_row_patches else None
        temporal = 1 if self.vae is None else self.vae.config.temporal_factor
        unet, _ = on_video(self.unet, frames, layout, temporal, (h, w), patches)
        pipe = replace(self, unet=unet)
        pipe.__dict__["_placed_cache"] = self.__dict__.setdefault("_placed_cache", {})
        return pipe

    def default_size(self, height: int | None, width: int | None) -> tuple[int, int]:
        """A frame's size in pixels, each side the model's where not given."""
        dh, dw = self.unet.default_size
        return (dh if height is None else height), (dw if width is None else width)

    @property
    def video(self) -> Video:
        return self.unet.video

    @property
    def latent_factor(self) -> int:
        return 1 if self.vae is None else self.vae.config.spatial_factor

    def frame_size(self, height: int, width: int) -> tuple[int, int]:
        """A frame's latent (h, w); ValueError naming the nearest sizes that fit."""
        return check_image_size(self.unet, self.latent_factor, height, width)

    def check_size(self, height: int, width: int, rows_multiple: int = 1) -> tuple[int, int]:
        """The tall latent's (rows, w) for a frame size: the frames' rows stacked."""
        h, w = check_image_size(self.unet, self.latent_factor, height, width, rows_multiple)
        return self.video.frames * h, w

    def initial_latents(self, batch: int, height: int, width: int, seed: int) -> jax.Array:
        """Unit Gaussian video latent (B, F, h, w, C) fixed by the seed, as the tall image."""
        check_seed(seed)
        h, w = self.frame_size(height, width)
        shape = (batch, self.video.frames, h, w, self.latent_channels)
        return self.to_tall(jax.random.normal(jax.random.key(seed), shape, jnp.float32))

    def to_tall(self, latents: jax.Array) -> jax.Array:
        return self.video.to_tall(jnp.asarray(latents), self.unet.row_multiple)

    def from_tall(self, latents: jax.Array) -> jax.Array:
        return self.video.from_tall(jnp.asarray(latents), self.unet.row_multiple)

    def decode(self, latents: jax.Array, vae_plan: VAEPlan | None = None) -> np.ndarray:
        """The tall final latent -> (B, T, H, W, 3) uint8 frames (WanPipeline's un-normalising,
        decode and post-processing), on one device or on row patches of every frame
        (`vae_plan` rows; tiles: ValueError). A pixel-space model's latent is the video in
        [-1, 1]: grey frames become RGB."""
        if self.vae is None:
            video = np.asarray(self.from_tall(latents), np.float32)
            video = np.repeat(video, 3, axis=-1) if video.shape[-1] == 1 else video
        else:
            z = self.vae.unnormalise(self.from_tall(latents).astype(self.vae.module.dtype))
            video = to_local(decode_video(self.vae, self.vae_params, z, vae_plan or VAEPlan()))
        video = np.asarray(video, np.float32)
        if not np.isfinite(video).all():
            raise NonFiniteError(
                f"the video VAE decode gave NaN or Inf in {int((~np.isfinite(video)).sum())} of "
                f"{video.size} pixel values: no frame of it is a result"
            )
        return np.round(np.clip(video / 2 + 0.5, 0, 1) * 255).astype(np.uint8)

    def __call__(  # noqa: D417 (the image pipeline's arguments, and these)
        self,
        prompts,
        height: int | None = None,
        width: int | None = None,
        steps: int = 20,
        guidance_scale: float = 5.0,
        seed: int = 0,
        sampler: str | None = None,
        negative_prompts=None,
        latents=None,
        plan: Plan | None = None,
        check_memory: bool = False,
        vae_plan: VAEPlan | None = None,
        log=None,
        frames: int | None = None,
        layout: str = "frames",
        guidance_scale_2: float | None = None,
    ) -> VideoOutput:
        """Videos of `frames` frames (default: the model's) for the prompts, the latent laid out
        by `layout` (`frames`, `rows` or `FxR`); `latents`, when given, is (B, F, h, w, C).
        `guidance_scale_2`: Wan 2.2 A14B's low-noise expert's scale (default `guidance_scale`).
        The rest is `Pipeline.__call__`'s (height and width of a frame, default the model's)."""
        height, width = self.default_size(height, width)
        frames = self.unet.default_frames if frames is None else frames
        pipe = self.at(frames, layout, height, width, plan)
        frame = pipe.frame_size(height, width)
        if vae_plan is not None:  # before any work: tiles refused, rows against a frame
            check_video_plan(vae_plan, self.vae, frame)
            if self.vae is None:  # pixel space: nothing to decode but on one device
                vae_plan.validate(None, frame)
        if latents is not None:
            want = (pipe.video.frames, *frame, pipe.latent_channels)
            if latents.ndim != 5 or tuple(latents.shape[1:]) != want:
                raise ValueError(
                    f"latents of shape {tuple(latents.shape)}: a video of {frames} frames of "
                    f"{height}x{width} takes (B, {', '.join(map(str, want))})"
                )
            latents = pipe.to_tall(latents)
        out = Pipeline.__call__(
            pipe, prompts, height, width, steps, guidance_scale, seed, sampler,
            negative_prompts, latents, plan, check_memory, vae_plan, log, guidance_scale_2,
        )  # fmt: skip
        final = np.asarray(pipe.from_tall(out.latents), np.float32)
        return VideoOutput(out.images, final, out.stale_bytes_per_device, out.cache, out.stages)
