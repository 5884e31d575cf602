"""The FLUX family (FLUX.1-dev, FLUX.1-schnell): `FluxTransformer2DModel` in Flax (`model`), its
presets (`presets`), the denoiser `FluxFn`, and `FAMILY`, what the rest of patchpar asks of it
(`patchpar.models.family`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec, resolve
from patchpar.models.components import abstract_init
from patchpar.models.family import Family, max_sequence_length
from patchpar.models.flux import presets as _presets
from patchpar.models.flux.model import (
    CLASS_NAMES,
    DOUBLE,
    LOGICAL,
    SINGLE,
    FluxConfig,
    FluxTransformer2DModel,
    apply_rope,
    rope_table,
)
from patchpar.models.wrapper import JointStack, ModuleDenoiser


@dataclass(frozen=True)
class FluxFn(ModuleDenoiser):
    """`flux_apply(params, sample (B, H, W, C), timesteps (B,), encoder_hidden_states (B, S, Dt),
    pooled_projections=(B, Dp), guidance=(B,) | None)` -> (B, H, W, C): the unpacked latent in
    and out (the 2 x 2 packing and the RoPE ids are the model's own), the timesteps as
    diffusers' transformer takes them (sigma in [0, 1]), diffusers' names for the rest."""

    module: FluxTransformer2DModel
    family = "flux"
    logical = LOGICAL  # its parameters' logical axes (`parallel.rules`)
    splits_columns = False  # its tokens and positions are cut by rows only
    text_tokens = 512  # FLUX.1-dev's T5 tokens: they join every block's sequence
    text_stream = True  # every device computes the text stream (`parallel.sites.text`)
    caches = ("fbcache", "taylorseer", "teacache")  # the step caches it has (`sampling.cache`)
    guidance_halves = 1  # guidance-distilled: the scale is an input, not a second half
    no_stack = ""  # it has one (`stack`)

    @property
    def stack(self) -> Stack:
        """The forward's parts, for a strategy that splits the layers (PipeFusion)."""
        return Stack(self.module)

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

    def image_tokens(self, h: int, w: int) -> int:
        """Tokens of an h x w latent (what FLUX's resolution-dependent shift reads)."""
        return (h // 2) * (w // 2)

    def check_split(self, model: int) -> None:
        """Tensor parallelism over `model` devices splits every block by whole heads: a
        single block's proj_out reads [attention heads | MLP] of each device joined, so the
        heads must divide (no zero-head padding, as the UNets and PixArt have)."""
        heads = self.config.num_attention_heads
        if model > 1 and heads % model:
            fits = [k for k in range(2, heads + 1) if heads % k == 0]
            raise ValueError(
                f"tensor parallel over model={model}: FLUX's {heads} attention heads must split "
                f"evenly (a single block's proj_out joins each device's attention heads and MLP "
                f"share); use a model degree in {fits}"
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
            {"params": self.prepare(params)},
            sample,
            timesteps,
            encoder_hidden_states,
            pooled_projections,
            guidance,
        )

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
        """The parameters' shapes, in the unrolled layout (as checkpoints hold them)."""
        args, added = self.example_inputs(1, 2, 2, seq=4)
        return abstract_init(self.module.clone(scan=False), *args, **added)


@dataclass(frozen=True)
class Stack(JointStack):
    """FLUX.1's transformer as a stack (`wrapper.JointStack`): two segments of identical
    blocks, the double-stream ones and then the single-stream ones (`segment_blocks`). Each
    block takes its rows of the RoPE table from the position site (`ops.positions`, the same
    collections as its attention's)."""

    module: FluxTransformer2DModel
    kv_name = "attn"  # the block's joint attention, whose image K/V a stage keeps
    segment_kv_names = (("attn",), ("attn",))  # per segment: double, single blocks

    @property
    def num_layers(self) -> int:
        return self.module.config.num_layers + self.module.config.num_single_layers

    @property
    def segment_layers(self) -> tuple[int, int]:
        """Double-stream, then single-stream blocks."""
        return self.module.config.num_layers, self.module.config.num_single_layers

    @property
    def patch_size(self) -> int:
        """Latent rows (and columns) per token: the 2 x 2 packing."""
        return 2

    def segment_blocks(self, params) -> tuple[list, list]:
        cfg = self.module.config
        return (
            [params[DOUBLE.format(i)] for i in range(cfg.num_layers)],
            [params[SINGLE.format(i)] for i in range(cfg.num_single_layers)],
        )

    def block_names(self) -> set[str]:
        cfg = self.module.config
        return {DOUBLE.format(i) for i in range(cfg.num_layers)} | {
            SINGLE.format(i) for i in range(cfg.num_single_layers)}  # fmt: skip

    def time(self, outer, timesteps, extras: dict):
        """(B, D): the timestep, guidance (dev) and pooled text embedded."""
        g, pooled = extras.get("guidance"), extras["pooled_projections"]
        run = lambda m, t, g, p: m.time(t, g, p, t.shape[0])  # noqa: E731
        return self._apply(self.module.ops, outer, run, timesteps, g, pooled)

    def embed(self, outer, ops, sample, variables=None, ctx=None):
        """(B, h, W, C) latent rows -> (image tokens, the text tokens `ctx`)."""
        nested = {k: {"pos_embed": v} for k, v in (variables or {}).items()}
        img, _ = self._apply(ops, outer, "embed", sample, variables=nested)
        return img, ctx

    def block(self, outer, ops, block_params, h, ctx, temb, row, variables=None, mutable=(),
              segment: int = 0):  # fmt: skip
        """Block 0 of `segment` (0: double, 1: single) with `block_params` on the (image,
        text) tokens -> (tokens, the `mutable` collections)."""
        del ctx  # the text tokens travel in h
        name = (DOUBLE if segment == 0 else SINGLE).format(0)
        img, txt = h
        rows = img.shape[1] // row

        def run(m, img, txt, temb):
            rope = m.pos_embed(rows, row)  # this slab's rows of the table
            part = m.double if segment == 0 else m.single
            return part(0, img, txt, temb, rope, row)

        own = variables or {}
        nested = {k: {name: v, "pos_embed": v.get(self.kv_name, {})} for k, v in own.items()}
        out = self._apply(ops, {**outer, name: block_params}, run, img, txt, temb,
                          variables=nested, mutable=mutable)  # fmt: skip
        return self._own(out, mutable, name)


@dataclass
class FluxConditioning:
    """FLUX.1: T5's last hidden states of `tokens` tokens (no mask: FluxPipeline lets the padding
    be attended), CLIP's pooled output (`pooled_projections`), and for a guidance-distilled
    model (dev) the guidance scale as an input (`guidance`); no classifier-free guidance, so
    one guidance half (G = 1) and the loop's scale 1 (`loop_scale`), unless true CFG is asked
    for (`true_cfg_scale` > 1: G = 2, [negative, positive], as diffusers' FluxPipeline)."""

    encoders: list  # [CLIP, T5]
    tokenizers: list
    tokens: int = 512  # the T5 tokens read (dev 512, schnell 256)
    # > 1: true classifier-free guidance over the distilled model (diffusers' true_cfg_scale):
    # the negative prompt ("" if none) is a second guidance half, the two predictions of each
    # step combined at this scale; the guidance input (dev) is the same for both halves
    true_cfg_scale: float = 1.0

    def loop_scale(self, guidance_scale: float) -> float:
        del guidance_scale  # an input of the model (dev) or nothing (schnell), never CFG here
        return self.true_cfg_scale if self.true_cfg_scale > 1 else 1.0

    def __call__(self, denoiser, prompts, negative, guidance_scale, height, width, empty_negative):
        import warnings

        from patchpar.models.components import encode_text
        from patchpar.sampling.guidance import Conditioning

        del height, width
        cfg = self.true_cfg_scale > 1
        if not empty_negative and not cfg:
            raise ValueError(
                "FLUX.1 takes a negative prompt only with true CFG (true_cfg_scale > 1): it is "
                "guidance-distilled (dev embeds the guidance scale, schnell has none)"
            )
        texts = list(negative) + list(prompts) if cfg else list(prompts)
        g, b = 2 if cfg else 1, len(prompts)
        (clip, clip_params), (t5, t5_params) = self.encoders
        clip_tok, t5_tok = self.tokenizers
        pooled = encode_text(clip, clip_params, jnp.asarray(clip_tok(texts)))["pooler_output"]
        ids, _ = t5_tok(texts, self.tokens)
        ctx = encode_text(t5, t5_params, jnp.asarray(ids))["last_hidden_state"]
        extras = {"pooled_projections": pooled.reshape(g, b, -1)}
        if denoiser.config.guidance_embeds:
            extras["guidance"] = jnp.full((g, b), guidance_scale, jnp.float32)
        elif guidance_scale not in (0.0, 1.0):
            warnings.warn(
                f"guidance_scale={guidance_scale}: this FLUX model (schnell-like) has no "
                "guidance input, so the scale is not used"
                + (f" (true CFG at {self.true_cfg_scale} is)" if cfg else ""),
                stacklevel=3,
            )
        return Conditioning(ctx.reshape((g, b) + ctx.shape[1:]), extras)


class FluxFamily(Family):
    name = "flux"
    denoiser_folder = "transformer"
    denoiser_classes = CLASS_NAMES
    pipeline_classes = ("FluxPipeline",)
    presets = _presets.PRESETS
    full_size = _presets.FULL_SIZE
    weighted = _presets.WEIGHTED
    default_guidance = 3.5  # diffusers' FluxPipeline (dev's embedded guidance scale)
    default_sampler = "flow_euler"  # flow matching: FlowMatchEulerDiscreteScheduler

    def denoiser(self, config, where, dtype=jnp.float32, attention=None) -> FluxFn:
        attn = attention if attention is not None else AttentionSpec()
        return FluxFn(FluxTransformer2DModel(FluxConfig.from_diffusers(config, where), dtype,
                                             attn=attn))  # fmt: skip

    def is_large(self, config: dict) -> bool:
        return config.get("num_attention_heads", 24) * config.get("attention_head_dim", 128) >= 1024

    def check_index(self, index: dict) -> None:
        max_sequence_length(index, 512, "FluxPipeline")

    def load_text(self, folder: Path, index: dict, dtype) -> FluxConditioning:
        from patchpar.models.components import load_t5_encoder, load_text_encoder
        from patchpar.models.loading import CheckpointError
        from patchpar.models.tokenizer import T5Tokenizer, load_tokenizer

        tokens = max_sequence_length(index, 512, "FluxPipeline")  # before loading anything
        for sub in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
            if not (folder / sub).is_dir():
                raise CheckpointError(
                    f"{str(folder)!r}: a FLUX pipeline needs {sub}/ (CLIP in text_encoder/, "
                    f"T5 in text_encoder_2/); it is missing"
                )
        clip = load_text_encoder(folder / "text_encoder", dtype)
        t5 = load_t5_encoder(folder / "text_encoder_2", dtype, subfolder="text_encoder_2")
        return FluxConditioning(
            [clip, t5],
            [
                load_tokenizer(folder / "tokenizer"),
                T5Tokenizer(folder / "tokenizer_2", lower=False),
            ],
            tokens,
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
        """A FLUX pipeline folder: transformer/, vae/, a CLIP text_encoder/ and tokenizer/, a T5
        text_encoder_2/ and its sentencepiece tokenizer_2/ (trained here on a few captions),
        scheduler/, model_index.json."""
        import json

        from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
        from patchpar.models.components import T5EncoderFn, TextEncoderFn, VAEFn
        from patchpar.models.configs import TOKENIZER_TEXT
        from patchpar.models.loading import write_component, write_scheduler
        from patchpar.models.t5 import T5Config, T5EncoderModel
        from patchpar.models.tokenizer import write_clip_tokenizer, write_t5_tokenizer
        from patchpar.models.vae import AutoencoderKL, VAEConfig

        folder = Path(folder)
        fn = self.denoiser(preset["transformer"], "transformer")
        write_component(folder / "transformer", preset["transformer"], fn.init(seed))
        vae = VAEFn(AutoencoderKL(VAEConfig.from_diffusers(preset["vae"]), jnp.float32))
        write_component(folder / "vae", preset["vae"], vae.init(seed + 1))
        clip = TextEncoderFn(
            CLIPTextModel(CLIPTextConfig.from_transformers(preset["text_encoder"]))
        )
        write_component(folder / "text_encoder", preset["text_encoder"], clip.init(seed + 2))
        write_clip_tokenizer(folder / "tokenizer")
        t5_cfg = preset["text_encoder_2"]
        t5 = T5EncoderFn(T5EncoderModel(T5Config.from_transformers(t5_cfg)))
        write_component(folder / "text_encoder_2", t5_cfg, t5.init(seed + 3))
        write_t5_tokenizer(folder / "tokenizer_2", TOKENIZER_TEXT, vocab_size=t5_cfg["vocab_size"])
        write_scheduler(folder, preset["scheduler"])
        index = {
            "_class_name": preset["pipeline"]["_class_name"],
            "transformer": ["diffusers", "FluxTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "text_encoder_2": ["transformers", "T5EncoderModel"],
            "tokenizer_2": ["transformers", "T5TokenizerFast"],
            "scheduler": ["diffusers", preset["scheduler"]["_class_name"]],
        }
        if "max_sequence_length" in preset["pipeline"]:
            index["max_sequence_length"] = preset["pipeline"]["max_sequence_length"]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def load_flux(path, dtype=jnp.float32, attention: AttentionSpec = AUTO):
    """FLUX.1 transformer from a diffusers folder (`.../transformer` or a pipeline folder
    holding `transformer/`)."""
    from patchpar.models.components import component

    return FAMILY.load_denoiser(component(path, "transformer"), dtype, resolve(attention, dtype))


FAMILY = FluxFamily()

__all__ = [
    "FAMILY", "LOGICAL", "FluxConfig", "FluxFn", "FluxTransformer2DModel", "Stack",
    "apply_rope", "load_flux", "rope_table",
]  # fmt: skip
