"""The FLUX family (FLUX.1-dev, FLUX.1-schnell): `FluxTransformer2DModel` in Flax (`model`), its
presets (`presets`), the denoiser `FluxFn`, and `FAMILY`, what the rest of patchpar asks of it
(`patchpar.models.family`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec, resolve
from patchpar.models.components import abstract_init, random_params
from patchpar.models.family import Family
from patchpar.models.flux import presets as _presets
from patchpar.models.flux.model import (
    CLASS_NAMES,
    LOGICAL,
    FluxConfig,
    FluxTransformer2DModel,
    apply_rope,
    rope_table,
)
from patchpar.models.sites import SiteOps


@dataclass(frozen=True)
class FluxFn:
    """`flux_apply(params, sample (B, H, W, C), timesteps (B,), encoder_hidden_states (B, S, Dt),
    pooled_projections=(B, Dp), guidance=(B,) | None)` -> (B, H, W, C): the unpacked latent in
    and out (the 2 x 2 packing and the RoPE ids are the model's own), the timesteps as
    diffusers' transformer takes them (sigma in [0, 1]), diffusers' names for the rest."""

    module: FluxTransformer2DModel
    family = "flux"
    logical = LOGICAL  # its parameters' logical axes (`parallel.rules`)
    splits_columns = False  # its tokens and positions are cut by rows only
    stack = None  # two kinds of blocks and a text stream: no layer split yet

    @property
    def config(self) -> FluxConfig:
        return self.module.config

    @property
    def row_multiple(self) -> int:
        """Latent rows of one patch must be even: a row slab is then whole 2 x 2 tokens."""
        return 2

    @property
    def row_multiple_reason(self) -> str:
        return "2 x 2 latent packing"

    def prediction(self, out: jax.Array) -> jax.Array:
        """The sampler's model output from the network's: all of it (the flow's velocity)."""
        return out

    def check_split(self, model: int) -> None:
        """Tensor parallel over `model` devices: the feed-forward and MLP widths (4 x the
        width) divide (heads need not: they are padded with zero heads)."""
        inner = 4 * self.config.inner_dim
        if model > 1 and inner % model:
            fits = [d for d in range(1, 9) if inner % d == 0]
            raise ValueError(
                f"tensor parallel over model={model}: the feed-forward width {inner} is not "
                f"divisible by {model}; degrees that divide it: {fits}"
            )

    def __call__(
        self,
        params,
        sample,
        timesteps,
        encoder_hidden_states,
        pooled_projections=None,
        guidance=None,
    ):
        if pooled_projections is None:
            raise ValueError("a FLUX transformer needs pooled_projections (CLIP's pooled output)")
        return self.module.apply(
            {"params": params},
            sample,
            timesteps,
            encoder_hidden_states,
            pooled_projections,
            guidance,
        )

    def with_ops(self, ops: SiteOps) -> FluxFn:
        return replace(self, module=self.module.clone(ops=ops))

    def with_attention(self, spec: AttentionSpec) -> FluxFn:
        return replace(self, module=self.module.clone(attn=spec))

    def example_inputs(
        self, batch: int = 1, height: int | None = None, width: int | None = None, seq: int = 512
    ):
        """Abstract inputs of the right shapes (latent size = sample_size unless given):
        (sample, timesteps, encoder_hidden_states) and the keyword inputs (the pooled text,
        and the guidance scale for a guidance-distilled model)."""
        cfg, dt = self.config, self.module.dtype
        h, w = height or cfg.sample_size, width or cfg.sample_size
        sds = jax.ShapeDtypeStruct
        args = (
            sds((batch, h, w, cfg.latent_channels), dt),
            sds((batch,), jnp.float32),
            sds((batch, seq, cfg.joint_attention_dim), dt),
        )
        added = {"pooled_projections": sds((batch, cfg.pooled_projection_dim), dt)}
        if cfg.guidance_embeds:
            added["guidance"] = sds((batch,), jnp.float32)
        return args, added

    def abstract_params(self):
        args, added = self.example_inputs(1, 2, 2, seq=4)
        return abstract_init(self.module, *args, **added)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


class FluxFamily(Family):
    name = "flux"
    denoiser_folder = "transformer"
    denoiser_classes = CLASS_NAMES
    pipeline_classes = ("FluxPipeline",)
    presets = _presets.PRESETS
    full_size = _presets.FULL_SIZE
    weighted = _presets.WEIGHTED
    default_guidance = 3.5  # diffusers' FluxPipeline (dev's embedded guidance scale)

    def denoiser(self, config, where, dtype=jnp.float32, attention=None) -> FluxFn:
        attn = attention if attention is not None else AttentionSpec()
        return FluxFn(FluxTransformer2DModel(FluxConfig.from_diffusers(config, where), dtype,
                                             attn=attn))  # fmt: skip

    def is_large(self, config: dict) -> bool:
        return config.get("num_attention_heads", 24) * config.get("attention_head_dim", 128) >= 1024

    def load_text(self, folder: Path, index: dict, dtype):
        raise NotImplementedError(
            f"{str(folder)!r}: the FLUX pipeline (CLIP + T5 conditioning, flow-matching "
            "sampler, 16-channel VAE) is not built yet; load its transformer with "
            "patchpar.models.load_denoiser"
        )

    def text_programs(self, component, batch: int, dtype):
        from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
        from patchpar.models.t5 import T5Config, T5EncoderModel

        out = []
        if (cfg := component("text_encoder")) is not None:
            module = CLIPTextModel(CLIPTextConfig.from_transformers(cfg, "text_encoder"), dtype)
            out.append((module, jax.ShapeDtypeStruct((batch, 77), jnp.int32)))
        if (cfg := component("text_encoder_2")) is not None:
            module = T5EncoderModel(T5Config.from_transformers(cfg, "text_encoder_2"), dtype)
            tokens = (component("pipeline") or {}).get("max_sequence_length", 512)
            out.append((module, jax.ShapeDtypeStruct((batch, tokens), jnp.int32)))
        return out

    def write_random_folder(self, folder: Path, preset: dict, seed: int) -> None:
        from patchpar.models.loading import write_component

        folder = Path(folder)
        fn = self.denoiser(preset["transformer"], "transformer")
        write_component(folder / "transformer", preset["transformer"], fn.init(seed))


def load_flux(path, dtype=jnp.float32, attention: AttentionSpec = AUTO):
    """FLUX.1 transformer from a diffusers folder (`.../transformer` or a pipeline folder
    holding `transformer/`)."""
    from patchpar.models.components import component

    return FAMILY.load_denoiser(component(path, "transformer"), dtype, resolve(attention, dtype))


FAMILY = FluxFamily()

__all__ = [
    "FAMILY", "LOGICAL", "FluxConfig", "FluxFn", "FluxTransformer2DModel", "apply_rope",
    "load_flux", "rope_table",
]  # fmt: skip
