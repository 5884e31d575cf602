"""The PixArt family (PixArt-α / Σ): `PixArtTransformer2DModel` in Flax (`model`), its presets
(`presets`), the denoiser `PixArtFn` and its layer `Stack`, the T5 conditioning of PixArt
pipelines, and `FAMILY`, what the rest of patchpar asks of it (`patchpar.models.family`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec, resolve
from patchpar.models.components import (
    T5EncoderFn,
    VAEFn,
    abstract_init,
    encode_text,
    load_t5_encoder,
)
from patchpar.models.family import Family
from patchpar.models.loading import CheckpointError, read_config, write_component, write_scheduler
from patchpar.models.pixart import presets as _presets
from patchpar.models.pixart.model import (
    BLOCK,
    CLASS_NAMES,
    LOGICAL,
    UNSUPPORTED,
    PixArtConfig,
    PixArtTransformer2DModel,
    sincos_table,
)
from patchpar.models.sites import SiteOps
from patchpar.models.t5 import T5Config, T5EncoderModel
from patchpar.models.vae import AutoencoderKL, VAEConfig
from patchpar.models.wrapper import TokenDenoiser, TokenStack


@dataclass(frozen=True)
class PixArtFn(TokenDenoiser):
    """`pixart_apply(params, sample (B, H, W, C), timesteps, encoder_hidden_states (B, S, Dt),
    encoder_attention_mask=None (B, S), added_cond_kwargs=None)` -> (B, H, W, out_channels);
    `added_cond_kwargs` holds `resolution` (B, 2) and `aspect_ratio` (B, 1) for a model with
    micro-conditions (diffusers' names throughout)."""

    module: PixArtTransformer2DModel
    family = "pixart"
    logical = LOGICAL  # its parameters' logical axes (`parallel.rules`)
    splits_columns = False  # its positions and tokens are cut by rows only
    no_stack = ""  # it has one (`stack`)
    # the text tokens abstract lowering assumes: 77, as the published comm records were
    # measured (its pipelines read 120 / 300; only cross-attention's FLOPs depend on it)
    text_tokens = 77
    text_stream = False  # every device computes the text stream (`parallel.sites.text`)
    caches = (
        "fbcache",
        "taylorseer",
        "teacache",
    )  # the step caches it has (`patchpar.sampling.cache`)
    guidance_halves = 2  # classifier-free guidance

    def prediction(self, out: jax.Array) -> jax.Array:
        """The sampler's model output from the network's: with learned sigma (twice the
        latent's channels) the first half, as diffusers' PixArt pipelines take it."""
        return out[..., : self.config.in_channels] if self.config.learned_sigma else out

    @property
    def stack(self) -> Stack:
        """The forward's parts, for a strategy that splits the layers (PipeFusion)."""
        return Stack(self.module)

    def __call__(
        self,
        params,
        sample,
        timesteps,
        encoder_hidden_states,
        encoder_attention_mask=None,
        added_cond_kwargs=None,
        **micro,
    ):
        # the micro-conditions come in diffusers' dict, or as keywords (a Conditioning's extras)
        added = {**(added_cond_kwargs or {}), **micro}
        unknown = sorted(set(added) - {"resolution", "aspect_ratio"})
        if unknown:
            raise ValueError(
                f"added_cond_kwargs {unknown} are not PixArt's (it takes resolution, aspect_ratio)"
            )
        if added and not self.config.use_additional_conditions:
            raise ValueError(
                "this PixArt transformer has no micro-conditions (use_additional_conditions is "
                f"off), but added_cond_kwargs={sorted(added)} were given"
            )
        return self.module.apply(
            {"params": self.prepare(params)},
            sample,
            timesteps,
            encoder_hidden_states,
            encoder_attention_mask,
            added.get("resolution"),
            added.get("aspect_ratio"),
        )

    def example_inputs(
        self, batch: int = 1, height: int | None = None, width: int | None = None, seq: int = 120
    ):
        """Abstract inputs of the right shapes (latent size = sample_size unless given):
        (sample, timesteps, encoder_hidden_states) and the module's keyword inputs (the text
        mask, and the micro-conditions if the model has them)."""
        cfg, dt = self.config, self.module.dtype
        h, w = height or cfg.sample_size, width or cfg.sample_size
        sds = jax.ShapeDtypeStruct
        text = cfg.caption_channels or cfg.inner_dim
        args = (
            sds((batch, h, w, cfg.in_channels), dt),
            sds((batch,), jnp.float32),
            sds((batch, seq, text), dt),
        )
        added = {"encoder_attention_mask": sds((batch, seq), jnp.int32)}
        if cfg.use_additional_conditions:
            added["resolution"] = sds((batch, 2), jnp.float32)
            added["aspect_ratio"] = sds((batch, 1), jnp.float32)
        return args, added

    def abstract_params(self):
        """The parameters' shapes, in the unrolled layout (as checkpoints hold them)."""
        args, added = self.example_inputs(1, self.config.patch_size, seq=4)
        return abstract_init(self.module.clone(scan=False), *args, **added)


@dataclass(frozen=True)
class Stack(TokenStack):
    """PixArt's transformer as a stack (`wrapper.TokenStack`): one segment of identical blocks;
    `extras` are the text mask and the micro-conditions."""

    module: PixArtTransformer2DModel
    segment_kv_names = (("attn1",),)  # per segment, the attentions whose K/V a stage keeps

    @property
    def segment_layers(self) -> tuple[int, ...]:
        """Blocks per segment of identical blocks."""
        return (self.num_layers,)

    def blocks(self, params) -> list:
        """The blocks' parameters in layer order."""
        return [params[BLOCK.format(i)] for i in range(self.num_layers)]

    def segment_blocks(self, params) -> tuple[list, ...]:
        """The blocks' parameters per segment of identical blocks, in layer order: one."""
        return (self.blocks(params),)

    def block_names(self) -> set[str]:
        return {BLOCK.format(i) for i in range(self.num_layers)}

    def context(self, outer, encoder_hidden_states, extras: dict):
        """The step-invariant text context: (projected caption, key mask)."""
        mask = extras.get("encoder_attention_mask")
        return self._apply(self.module.ops, outer, "context", encoder_hidden_states, mask)

    def time(self, outer, timesteps, extras: dict):
        """The timestep's embeddings: ((B, 6, D) block modulations, (B, D) embedded)."""
        args = (timesteps, extras.get("resolution"), extras.get("aspect_ratio"))
        return self._apply(self.module.ops, outer, "time", *args)

    def embed(self, outer, ops: SiteOps, sample, variables=None, ctx=None) -> jax.Array:
        """(B, h, W, C) latent rows -> (B, h/p * W/p, D) tokens with their positions
        (`ops.positions`); `variables` of the patch embedding (`ctx`, the context, enters
        every block by cross-attention instead)."""
        del ctx
        nested = {k: {"pos_embed": v} for k, v in (variables or {}).items()}
        return self._apply(ops, outer, "embed", sample, variables=nested)

    def block(self, outer, ops, block_params, x, ctx, temb, row, variables=None, mutable=(),
              segment: int = 0):  # fmt: skip
        """One block on (B, T, D) tokens -> (tokens, the `mutable` collections)."""
        del segment  # one segment
        name = BLOCK.format(0)  # every block is alike: the parameters given run as block 0
        nested = {k: {name: v} for k, v in (variables or {}).items()}
        params = {**outer, name: block_params}
        out = self._apply(ops, params, lambda m, *a: m.block(0, *a), x, ctx, temb, row,
                          variables=nested, mutable=mutable)  # fmt: skip
        return self._own(out, mutable, name)


@dataclass
class T5Conditioning:
    """PixArt: T5's last hidden states and their mask (the negative prompt encoded as any
    other, "" by default), and the micro-conditions (height, width) and height / width of the
    image when the transformer has them, the same for both guidance halves."""

    encoders: list
    tokenizers: list
    tokens: int = 120  # the T5 tokens read (PixArt-α 120, Σ 300)

    def loop_scale(self, guidance_scale: float) -> float:
        return guidance_scale  # classifier-free guidance

    def __call__(self, denoiser, prompts, negative, guidance_scale, height, width, empty_negative):
        from patchpar.sampling.guidance import Conditioning

        del empty_negative
        cfg = guidance_scale > 1.0
        (fn, params), tok = self.encoders[0], self.tokenizers[0]
        texts = [*negative, *prompts] if cfg else prompts
        ids, mask = tok(texts, self.tokens)
        g, b = 1 + cfg, len(prompts)
        ctx = encode_text(fn, params, jnp.asarray(ids), jnp.asarray(mask))["last_hidden_state"]
        extras = {"encoder_attention_mask": jnp.asarray(mask).reshape(g, b, -1)}
        if denoiser.config.use_additional_conditions:
            size = jnp.asarray([height, width], jnp.float32)
            extras["resolution"] = jnp.broadcast_to(size, (g, b, 2))
            ratio = jnp.asarray([height / width], jnp.float32)
            extras["aspect_ratio"] = jnp.broadcast_to(ratio, (g, b, 1))
        return Conditioning(ctx.reshape((g, b) + ctx.shape[1:]), extras)


class PixArtFamily(Family):
    name = "pixart"
    denoiser_folder = "transformer"
    denoiser_classes = CLASS_NAMES
    pipeline_classes = ("PixArtAlphaPipeline", "PixArtSigmaPipeline")
    presets = _presets.PRESETS
    full_size = _presets.FULL_SIZE
    weighted = _presets.WEIGHTED
    default_guidance = 4.5  # diffusers' PixArt-α/Σ pipelines

    def denoiser(self, config, where, dtype=jnp.float32, attention=None) -> PixArtFn:
        attn = attention if attention is not None else AttentionSpec()
        return PixArtFn(PixArtTransformer2DModel(PixArtConfig.from_diffusers(config, where), dtype,
                                                 attn=attn))  # fmt: skip

    def is_large(self, config: dict) -> bool:
        return config["num_attention_heads"] * config["attention_head_dim"] >= 1024

    def text_tokens(self, index: dict) -> int:
        """The T5 tokens a pipeline class reads (120 without model_index.json)."""
        return _presets.MAX_TEXT_TOKENS.get(index.get("_class_name"), 120)

    def load_text(self, folder: Path, index: dict, dtype) -> T5Conditioning:
        from patchpar.models.tokenizer import T5Tokenizer

        for sub in ("text_encoder", "tokenizer"):
            if not (folder / sub).is_dir():
                raise CheckpointError(
                    f"{str(folder)!r}: a PixArt pipeline needs {sub}/; it is missing"
                )
        encoder = load_t5_encoder(folder / "text_encoder", dtype)
        tokenizer = T5Tokenizer(folder / "tokenizer")
        return T5Conditioning([encoder], [tokenizer], self.text_tokens(index))

    def text_programs(self, component, batch: int, dtype):
        cfg = component("text_encoder")
        if cfg is None:
            return []
        module = T5EncoderModel(T5Config.from_transformers(cfg, "text_encoder"), dtype)
        tokens = self.text_tokens(component("pipeline") or {})
        return [(module, jax.ShapeDtypeStruct((batch, tokens), jnp.int32))]

    def write_random_folder(self, folder: Path, preset: dict, seed: int) -> None:
        """A PixArt pipeline folder: transformer/, vae/, a T5 text_encoder/ and its
        sentencepiece tokenizer/ (trained here on a few captions), scheduler/,
        model_index.json."""
        from patchpar.models.configs import TOKENIZER_TEXT
        from patchpar.models.tokenizer import write_t5_tokenizer

        folder = Path(folder)
        dit = self.denoiser(preset["transformer"], "transformer")
        write_component(folder / "transformer", preset["transformer"], dit.init(seed))
        vae = VAEFn(AutoencoderKL(VAEConfig.from_diffusers(preset["vae"]), jnp.float32))
        write_component(folder / "vae", preset["vae"], vae.init(seed + 1))
        t5 = T5EncoderFn(T5EncoderModel(T5Config.from_transformers(preset["text_encoder"])))
        write_component(folder / "text_encoder", preset["text_encoder"], t5.init(seed + 2))
        vocab = preset["text_encoder"]["vocab_size"]
        write_t5_tokenizer(folder / "tokenizer", TOKENIZER_TEXT, vocab_size=vocab)
        write_scheduler(folder, preset["scheduler"])
        index = {
            "_class_name": preset["pipeline"]["_class_name"],
            "transformer": ["diffusers", "PixArtTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"],
            "text_encoder": ["transformers", "T5EncoderModel"],
            "tokenizer": ["transformers", "T5Tokenizer"],
            "scheduler": ["diffusers", preset["scheduler"]["_class_name"]],
        }
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def load_pixart(path, dtype=jnp.float32, attention: AttentionSpec = AUTO):
    """PixArt-α/Σ transformer from a diffusers folder (`.../transformer` or a pipeline folder
    holding `transformer/`)."""
    from patchpar.models.components import component

    return FAMILY.load_denoiser(component(path, "transformer"), dtype, resolve(attention, dtype))


FAMILY = PixArtFamily()

__all__ = [
    "FAMILY", "LOGICAL", "UNSUPPORTED", "PixArtConfig", "PixArtFn", "PixArtTransformer2DModel",
    "Stack", "T5Conditioning", "load_pixart", "read_config", "sincos_table",
]  # fmt: skip
