"""The Wan family (Wan 2.1 / 2.2 text-to-video): `WanTransformer3DModel` in Flax (`model`), on a
video laid out as a tall image (`model.Video`), its VAE's decoder (`vae`), and the denoiser
`WanFn` the engine runs. Not yet a registered family (`patchpar.models.family.PACKAGES`): its
folders, presets, text conditioning and video pipeline come next."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from patchpar.models.components import abstract_init
from patchpar.models.wan.model import LOGICAL, Video, WanConfig, WanTransformer3DModel
from patchpar.models.wrapper import TokenDenoiser


@dataclass(frozen=True)
class WanFn(TokenDenoiser):
    """`wan_apply(params, sample (B, R, W, C), timesteps (B,), encoder_hidden_states (B, S, Dt))`
    -> (B, R, W, C): `sample` a video of `module.video.frames` frames laid out as a tall image
    of R rows (`Video.to_tall`); timesteps as the UniPC scheduler gives them (0..1000)."""

    module: WanTransformer3DModel
    family = "wan"
    logical = LOGICAL  # its parameters' logical axes (`parallel.rules`)
    splits_columns = False  # its positions are cut by rows of the tall image only
    no_stack = "its stack of blocks for PipeFusion and AsyncDiff is not built yet"
    text_tokens = 512  # the umT5 tokens WanPipeline reads (max_sequence_length)
    text_stream = False  # the text enters by cross-attention on every device
    caches = ("fbcache", "taylorseer")  # no TeaCache coefficients for Wan here
    guidance_halves = 2  # classifier-free guidance

    @property
    def row_multiple(self) -> int:
        """Rows of the tall image per token row: a patch is a run of whole token rows, which
        the layout puts in frame, row or block order."""
        return self.config.spatial_patch

    @property
    def row_multiple_reason(self) -> str:
        return f"patch size {self.config.spatial_patch}"

    @property
    def video(self) -> Video:
        return self.module.video

    def with_video(self, video: Video) -> WanFn:
        """The same denoiser on another video layout (frames, order)."""
        return dataclasses.replace(self, module=self.module.clone(video=video))

    def image_tokens(self, h: int, w: int) -> int:
        p = self.config.spatial_patch
        return (h // p) * (w // p)

    def check_split(self, model: int) -> None:
        """Tensor parallel over `model` devices: the feed-forward's inner width divides."""
        inner = self.config.ffn_dim
        if model > 1 and inner % model:
            fits = [d for d in range(2, 9) if inner % d == 0]
            raise ValueError(
                f"tensor parallel over model={model}: Wan's feed-forward width {inner} is not "
                f"divisible by {model}; degrees that divide it: {fits}"
            )

    @property
    def stack(self):
        return None

    def prediction(self, out: jax.Array) -> jax.Array:
        return out  # the flow's velocity

    def __call__(self, params, sample, timesteps, encoder_hidden_states):
        return self.module.apply(
            {"params": self.prepare(params)}, sample, timesteps, encoder_hidden_states
        )

    def example_inputs(self, batch: int = 1, height=None, width=None, seq: int = 512):
        """Abstract inputs: the tall image of `module.video` (height = its rows, default one
        frame of 2 token rows per frame), timesteps, umT5 states."""
        cfg, dt = self.config, self.module.dtype
        p = cfg.spatial_patch
        h = height or 2 * p * self.video.frames
        w = width or 2 * p
        sds = jax.ShapeDtypeStruct
        args = (
            sds((batch, h, w, cfg.in_channels), dt),
            sds((batch,), jnp.float32),
            sds((batch, seq, cfg.text_dim), dt),
        )
        return args, {}

    def abstract_params(self):
        """The parameters' shapes, in the unrolled layout (as checkpoints hold them)."""
        args, added = self.example_inputs(1, seq=4)
        return abstract_init(self.module.clone(scan=False), *args, **added)


def wan_denoiser(config: dict, video: Video | None = None, dtype=jnp.float32, where="config.json"):
    """The denoiser of a diffusers Wan transformer config.json, on `video` (None: one frame)."""
    cfg = WanConfig.from_diffusers(config, where)
    return WanFn(WanTransformer3DModel(cfg, video or Video(), dtype))


__all__ = ["Video", "WanConfig", "WanFn", "WanTransformer3DModel", "wan_denoiser"]
