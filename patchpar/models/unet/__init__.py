"""The UNet family (SD 1.x, SD 2.x, SDXL): `UNet2DConditionModel` in Flax (`model`), its presets
(`presets`), the denoiser `UNetFn`, the CLIP conditioning of SD and SDXL pipelines, and
`FAMILY`, what the rest of patchpar asks of it (`patchpar.models.family`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec, resolve
from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
from patchpar.models.components import (
    TextEncoderFn,
    VAEFn,
    abstract_init,
    encode_text,
    load_text_encoder,
)
from patchpar.models.family import Family
from patchpar.models.loading import CheckpointError, write_component, write_scheduler
from patchpar.models.unet import presets as _presets
from patchpar.models.unet.model import LOGICAL, UNet2DConditionModel, UNetConfig
from patchpar.models.vae import AutoencoderKL, VAEConfig
from patchpar.models.wrapper import ModuleDenoiser


@dataclass(frozen=True)
class UNetFn(ModuleDenoiser):
    """`unet_apply(params, sample, timesteps, encoder_hidden_states, text_embeds=, time_ids=)`."""

    module: UNet2DConditionModel
    family = "unet"
    logical = LOGICAL  # its parameters' logical axes (`parallel.rules`)
    splits_columns = True  # convolutions and GroupNorm cut as well by columns as by rows
    text_tokens = 77  # CLIP's
    text_stream = False  # every device computes the text stream (`parallel.sites.text`)
    caches = ("taylorseer", "deepcache")  # the step caches it has (`patchpar.sampling.cache`)
    guidance_halves = 2  # classifier-free guidance
    stack = None  # no stack of identical blocks
    no_stack = "its levels differ in width and resolution"

    @property
    def row_multiple(self) -> int:
        """Latent rows (and columns) of one patch must be a multiple of this: 2^d for d
        downsamplings, so that the deepest activation splits evenly."""
        return 2**self.config.num_downsamples

    @property
    def row_multiple_reason(self) -> str:
        return f"2^{self.config.num_downsamples} UNet downsamplings"

    def prediction(self, out: jax.Array) -> jax.Array:
        """The sampler's model output from the network's: all of it."""
        return out

    def check_split(self, model: int) -> None:
        """Tensor parallel over `model` devices: every split width divides (the ResNet widths
        and their GroupNorm groups; heads need not: they are padded with zero heads)."""
        if model == 1:
            return
        cfg = self.config
        sizes = {
            "block_out_channels": tuple(cfg.block_out_channels),
            "norm_num_groups": (cfg.norm_num_groups,),
        }
        every = [v for vs in sizes.values() for v in vs]
        fits = [d for d in range(1, max(every) + 1) if all(v % d == 0 for v in every)]
        for what, values in sizes.items():
            if any(v % model for v in values):
                raise ValueError(
                    f"tensor parallel over model={model}: {what} {list(values)} are not all "
                    f"divisible by {model} (ResNet middle channels and their GroupNorm groups "
                    f"are split); degrees that divide every split width: {fits}"
                )

    def __call__(self, params, sample, timesteps, encoder_hidden_states, **added_cond):
        return self.module.apply(
            {"params": self.prepare(params)},
            sample,
            timesteps,
            encoder_hidden_states,
            **added_cond,
        )

    def example_inputs(
        self, batch: int = 1, height: int | None = None, width: int | None = None, seq: int = 77
    ):
        """Abstract inputs of the right shapes (latent size = sample_size unless given)."""
        cfg, dt = self.config, self.module.dtype
        h, w = height or cfg.sample_size, width or cfg.sample_size
        sds = jax.ShapeDtypeStruct
        args = (
            sds((batch, h, w, cfg.in_channels), dt),
            sds((batch,), jnp.float32),
            sds((batch, seq, cfg.cross_attention_dim), dt),
        )
        added = {}
        if cfg.addition_embed_type == "text_time":
            pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
            added = {
                "text_embeds": sds((batch, pooled), dt),
                "time_ids": sds((batch, 6), jnp.float32),
            }
        return args, added

    def abstract_params(self):
        args, added = self.example_inputs(1, self.row_multiple)
        return abstract_init(self.module.clone(scan=False), *args, **added)


@dataclass
class CLIPConditioning:
    """SD: the CLIP encoder's last hidden state. SDXL (two encoders): both encoders'
    penultimate states concatenated, the second's projected pooled output (`text_embeds`) and
    the size conditioning (`time_ids`: original size, crop, target size)."""

    encoders: list
    tokenizers: list
    force_zeros: bool = True  # SDXL: "" negatives get zero embeddings (model_index.json)

    @property
    def xl(self) -> bool:
        return len(self.encoders) == 2

    def loop_scale(self, guidance_scale: float) -> float:
        return guidance_scale  # classifier-free guidance

    def __call__(self, denoiser, prompts, negative, guidance_scale, height, width, empty_negative):
        from patchpar.sampling.guidance import Conditioning

        del denoiser
        cfg = guidance_scale > 1.0
        ctx, pooled = self._embed(prompts)
        g = 2 if cfg else 1
        if cfg:
            if self.xl and self.force_zeros and empty_negative:
                nctx, npooled = jnp.zeros_like(ctx), jnp.zeros_like(pooled)
            else:
                nctx, npooled = self._embed(negative)
            ctx = jnp.stack([nctx, ctx])
            pooled = None if pooled is None else jnp.stack([npooled, pooled])
        else:
            ctx, pooled = ctx[None], None if pooled is None else pooled[None]
        if not self.xl:
            return Conditioning(ctx)
        tid = jnp.asarray([height, width, 0, 0, height, width], jnp.float32)
        return Conditioning(
            ctx, {"text_embeds": pooled, "time_ids": jnp.broadcast_to(tid, (g, len(prompts), 6))}
        )

    def _embed(self, prompts: list[str]) -> tuple[jax.Array, jax.Array | None]:
        states, pooled = [], None
        for (fn, params), tok in zip(self.encoders, self.tokenizers, strict=True):
            out = encode_text(fn, params, jnp.asarray(tok(prompts)))
            if self.xl:
                states.append(out["hidden_states"][-2])
                pooled = out.get("text_embeds", out["pooler_output"])
            else:
                states.append(out["last_hidden_state"])
        return jnp.concatenate(states, axis=-1), pooled


class UNetFamily(Family):
    name = "unet"
    denoiser_folder = "unet"
    denoiser_classes = ("UNet2DConditionModel",)
    pipeline_classes = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")
    presets = _presets.PRESETS
    full_size = _presets.FULL_SIZE
    weighted = _presets.WEIGHTED
    default_guidance = 7.5  # diffusers' SD pipelines

    def denoiser(self, config, where, dtype=jnp.float32, attention=None) -> UNetFn:
        attn = attention if attention is not None else AttentionSpec()
        return UNetFn(
            UNet2DConditionModel(UNetConfig.from_diffusers(config, where), dtype, attn=attn)
        )

    def is_large(self, config: dict) -> bool:
        return config["block_out_channels"][0] >= 320  # SD 1.x/2.x/XL widths

    def load_text(self, folder: Path, index: dict, dtype) -> CLIPConditioning:
        from patchpar.models.tokenizer import load_tokenizer

        encoders, tokenizers = [], []
        for sub in ("text_encoder", "text_encoder_2"):
            if (folder / sub).is_dir():
                encoders.append(load_text_encoder(folder / sub, dtype))
                tokenizers.append(load_tokenizer(folder / sub.replace("text_encoder", "tokenizer")))
        if not encoders:
            raise CheckpointError(f"{str(folder)!r} has no text_encoder/ folder")
        return CLIPConditioning(
            encoders, tokenizers, index.get("force_zeros_for_empty_prompt", True)
        )

    def text_programs(self, component, batch: int, dtype):
        out = []
        for sub in ("text_encoder", "text_encoder_2"):
            if (cfg := component(sub)) is not None:
                module = CLIPTextModel(CLIPTextConfig.from_transformers(cfg, sub), dtype)
                out.append((module, jax.ShapeDtypeStruct((batch, 77), jnp.int32)))
        return out

    def write_random_folder(self, folder: Path, preset: dict, seed: int) -> None:
        from patchpar.models.tokenizer import write_clip_tokenizer

        folder = Path(folder)
        unet = self.denoiser(preset["unet"], "unet", jnp.float32)
        write_component(folder / "unet", preset["unet"], unet.init(seed))
        index = {
            "_class_name": "StableDiffusionPipeline",
            "unet": ["diffusers", "UNet2DConditionModel"],
            "scheduler": ["diffusers", "DDIMScheduler"],
        }
        if "vae" in preset:  # none: a pixel-space model
            vae = VAEFn(AutoencoderKL(VAEConfig.from_diffusers(preset["vae"]), jnp.float32))
            write_component(folder / "vae", preset["vae"], vae.init(seed + 1))
            index["vae"] = ["diffusers", "AutoencoderKL"]
        for k, sub in enumerate(("text_encoder", "text_encoder_2")):
            if sub not in preset:
                continue
            te = TextEncoderFn(CLIPTextModel(CLIPTextConfig.from_transformers(preset[sub])))
            write_component(folder / sub, preset[sub], te.init(seed + 2 + k))
            write_clip_tokenizer(folder / sub.replace("text_encoder", "tokenizer"))
            index[sub] = ["transformers", preset[sub]["architectures"][0]]
            index[sub.replace("text_encoder", "tokenizer")] = ["transformers", "CLIPTokenizer"]
        if "text_encoder_2" in preset:
            index["_class_name"] = "StableDiffusionXLPipeline"
        write_scheduler(folder, preset["scheduler"])
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def load_unet(path, dtype=jnp.float32, attention: AttentionSpec = AUTO) -> tuple[UNetFn, dict]:
    """UNet from a diffusers folder (`.../unet` or a pipeline folder holding `unet/`).
    `attention` is resolved for this backend and dtype first (an unavailable kernel raises)."""
    from patchpar.models.components import component

    return FAMILY.load_denoiser(component(path, "unet"), dtype, resolve(attention, dtype))


FAMILY = UNetFamily()

__all__ = ["FAMILY", "LOGICAL", "CLIPConditioning", "UNet2DConditionModel", "UNetConfig", "UNetFn",
           "load_unet"]  # fmt: skip
