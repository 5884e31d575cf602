"""The Wan family (Wan 2.1 / 2.2 text-to-video): `WanTransformer3DModel` in Flax (`model`), on a
video laid out as a tall image (`model.Video`), its VAE's decoder (`vae`), its presets
(`presets`), the denoiser `WanFn` the engine runs, the umT5 conditioning of WanPipeline, and
`FAMILY`, what the rest of patchpar asks of it (`patchpar.models.family`). Its pipelines make
video (`patchpar.pipelines.text2video`)."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec
from patchpar.models.components import abstract_init, encode_text, random_params
from patchpar.models.family import Family, max_sequence_length
from patchpar.models.loading import CheckpointError, read_config
from patchpar.models.wan import presets as _presets
from patchpar.models.wan.model import (
    BLOCKS,
    CLASS_NAMES,
    LOGICAL,
    Video,
    WanConfig,
    WanTransformer3DModel,
)
from patchpar.models.wan.vae import WanVAEConfig, WanVAEDecoder, decode
from patchpar.models.wrapper import TokenDenoiser, TokenStack

BLOCK = BLOCKS + "_{}"  # a block's parameters, unrolled


@dataclass(frozen=True)
class WanFn(TokenDenoiser):
    """`wan_apply(params, sample (B, R, W, C), timesteps (B,), encoder_hidden_states (B, S, Dt))`
    -> (B, R, W, C): `sample` a video of `module.video.frames` frames laid out as a tall image
    of R rows (`Video.to_tall`); timesteps as the UniPC scheduler gives them (0..1000)."""

    module: WanTransformer3DModel
    family = "wan"
    logical = LOGICAL  # its parameters' logical axes (`parallel.rules`)
    splits_columns = False  # its positions are cut by rows of the tall image only
    no_stack = ""  # it has one (`stack`)
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
    def default_size(self) -> tuple[int, int]:
        """The frame size (pixels) a pipeline makes unless told: the config's `sample_height`
        and `sample_width`, else WanPipeline's 480 x 832."""
        extra = self.config.extra
        return extra.get("sample_height", 480), extra.get("sample_width", 832)

    @property
    def default_frames(self) -> int:
        """The frames a pipeline makes unless told: `sample_frames`, else WanPipeline's 81."""
        return self.config.extra.get("sample_frames", 81)

    @property
    def video(self) -> Video:
        return self.module.video

    def with_video(self, video: Video) -> WanFn:
        """The same denoiser on another video layout (frames, order)."""
        return dataclasses.replace(self, module=self.module.clone(video=video))

    def as_patch(self, rows: tuple[int, ...]) -> WanFn:
        """The denoiser each row patch of the tall image (`rows` latent rows each) runs alone
        (naive patch): on the video its slab holds (`Video.patch`), positions its own;
        ValueError for uneven patches (a slab of another size or cutting a frame)."""
        video, n = self.video, len(rows)
        token_rows = sum(rows) // self.row_multiple // video.frames  # a frame's
        if len(set(rows)) > 1:
            cut = {"frames": video.frames, "rows": token_rows}.get(video.layout)
            fits = "" if cut is None else (
                f"; devices that divide the {video.layout}: "
                f"{[d for d in range(2, cut + 1) if cut % d == 0]}"
            )  # fmt: skip
            raise ValueError(
                f"naive_patch on a video over uneven patches ({', '.join(map(str, rows))} latent "
                f"rows): each device denoises its slab alone as a whole video, so the slabs "
                f"must be equal blocks of it; leave patch_weights unset{fits}"
            )
        return self.with_video(video.patch(n, token_rows))

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
    def stack(self) -> Stack:
        """The forward's parts, for a strategy that splits the layers (PipeFusion, AsyncDiff)."""
        return Stack(self.module)

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


@dataclass(frozen=True)
class Stack(TokenStack):
    """Wan's transformer as a stack (`wrapper.TokenStack`): one segment of identical blocks.
    The time part gives (the blocks' modulations, the head's embedding); each block takes its
    rows of the RoPE table from the position site (`WanRope`, the same collections as its
    self-attention's, `attn1`)."""

    module: WanTransformer3DModel
    segment_kv_names = (("attn1",),)  # per segment, the attentions whose K/V a stage keeps

    @property
    def segment_layers(self) -> tuple[int, ...]:
        return (self.num_layers,)

    @property
    def patch_size(self) -> int:
        return self.module.config.spatial_patch

    def segment_blocks(self, params) -> tuple[list, ...]:
        return ([params[BLOCK.format(i)] for i in range(self.num_layers)],)

    def block_names(self) -> set[str]:
        return {BLOCK.format(i) for i in range(self.num_layers)}

    def context(self, outer, encoder_hidden_states, extras: dict):
        """The projected text (B, S, D): step-invariant."""
        return self._apply(self.module.ops, outer, "context", encoder_hidden_states)

    def time(self, outer, timesteps, extras: dict):
        """((B, 6, D) the blocks' modulations, (B, D) the head's)."""
        return self._apply(self.module.ops, outer, "time", timesteps)

    def embed(self, outer, ops, sample, variables=None, ctx=None):
        """(B, h, W, C) rows of the tall image -> (B, h/p * W/p, D) tokens (the text, `ctx`,
        enters every block by cross-attention)."""
        del ctx
        nested = {k: {"rope": v} for k, v in (variables or {}).items()}
        tokens, _ = self._apply(ops, outer, "embed", sample, variables=nested)
        return tokens

    def block(self, outer, ops, block_params, x, ctx, temb, row, variables=None, mutable=(),
              segment: int = 0):  # fmt: skip
        """One block on (B, T, D) tokens of `row` tokens per row -> (tokens, the `mutable`
        collections)."""
        del segment  # one segment
        name = BLOCK.format(0)  # every block is alike: the parameters given run as block 0
        rows = x.shape[1] // row

        def run(m, x, ctx, t6):
            return m.block(0, x, ctx, t6, m.rope(rows, row), row)

        own = variables or {}
        nested = {k: {name: v, "rope": v.get("attn1", {})} for k, v in own.items()}
        out = self._apply(ops, {**outer, name: block_params}, run, x, ctx, temb[0],
                          variables=nested, mutable=mutable)  # fmt: skip
        return self._own(out, mutable, name)

    def head(self, outer, x, temb, rows: int, w: int):
        return self._apply(self.module.ops, outer, "head", x, temb[1], rows, w)


def wan_denoiser(config: dict, video: Video | None = None, dtype=jnp.float32, where="config.json",
                 attention: AttentionSpec = AUTO) -> WanFn:  # fmt: skip
    """The denoiser of a diffusers Wan transformer config.json, on `video` (None: one frame)."""
    cfg = WanConfig.from_diffusers(config, where)
    return WanFn(WanTransformer3DModel(cfg, video or Video(), dtype, attn=attention))


# ---------------------------------------------------------------------------- the VAE


@dataclass(frozen=True)
class WanVAEFn:
    """Wan's video VAE, its decoder alone (`vae.decode`): latents (B, F, h, w, z), already
    un-normalised, -> frames (B, 1 + 4 (F - 1), 8h, 8w, 3) in [-1, 1]."""

    module: WanVAEDecoder

    @property
    def config(self) -> WanVAEConfig:
        return self.module.config

    def decode(self, params, z: jax.Array) -> jax.Array:
        return decode(self.module, params, z)

    def with_ops(self, ops) -> WanVAEFn:
        """The decoder on the site ops `ops` (row patches: `parallel.vae.decode_video`)."""
        return dataclasses.replace(self, module=self.module.clone(ops=ops))

    def unnormalise(self, latents: jax.Array) -> jax.Array:
        """The sampler's latent (B, F, h, w, z) as the decoder takes it: x std + mean per channel
        (diffusers' `latents / (1 / std) + mean`)."""
        cfg = self.config
        if not cfg.latents_mean:
            return latents
        mean = jnp.asarray(cfg.latents_mean, jnp.float32)
        inv = 1.0 / jnp.asarray(cfg.latents_std, jnp.float32)
        return (latents.astype(jnp.float32) / inv + mean).astype(latents.dtype)

    def abstract_params(self):
        z = jax.ShapeDtypeStruct((1, 1, 2, 2, self.config.z_dim), self.module.dtype)
        return abstract_init(self.module, z)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


def load_wan_vae(path: Path, dtype=jnp.float32) -> tuple[WanVAEFn, dict]:
    """The decoder of an AutoencoderKLWan folder (its encoder's weights are not read)."""
    from patchpar.models.loading import read_state_dict, state_dict_to_params

    cfg = WanVAEConfig.from_diffusers(read_config(path), f"{path}/config.json")
    fn = WanVAEFn(WanVAEDecoder(cfg, dtype))
    state = {k: v for k, v in read_state_dict(path).items()
             if k.startswith(("decoder.", "post_quant_conv."))}  # fmt: skip
    return fn, state_dict_to_params(state, fn.abstract_params(), str(path), dtype=dtype)


# ---------------------------------------------------------------------------- the text


def prompt_clean(text: str) -> str:
    """WanPipeline's prompt cleaning: HTML entities undone (twice), runs of white space one
    space, stripped (diffusers also runs ftfy's text fixes where ftfy is installed; patchpar
    does not depend on it)."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


@dataclass
class UMT5Conditioning:
    """WanPipeline's text: each prompt cleaned, umT5's last hidden states over its own tokens
    (the mask given to the encoder), zero beyond them up to `tokens` (no mask reaches the
    transformer); the negative prompt encoded the same way ("" by default)."""

    encoders: list
    tokenizers: list
    tokens: int = 512  # the umT5 tokens read (WanPipeline's max_sequence_length)

    def loop_scale(self, guidance_scale: float) -> float:
        return guidance_scale  # classifier-free guidance

    def __call__(self, denoiser, prompts, negative, guidance_scale, height, width, empty_negative):
        from patchpar.sampling.guidance import Conditioning

        del height, width, empty_negative
        cfg = guidance_scale > 1.0
        (fn, params), tok = self.encoders[0], self.tokenizers[0]
        texts = [prompt_clean(t) for t in ([*negative, *prompts] if cfg else prompts)]
        ids, mask = tok(texts, self.tokens)
        mask = jnp.asarray(mask)
        ctx = encode_text(fn, params, jnp.asarray(ids), mask)["last_hidden_state"]
        ctx = ctx * mask[..., None].astype(ctx.dtype)
        g, b = 1 + cfg, len(prompts)
        return Conditioning(ctx.reshape((g, b) + ctx.shape[1:]), {})


# ---------------------------------------------------------------------------- the family

BLOCK_PREFIX = ("blocks.", "transformer_blocks.")  # diffusers' block keys -> the module's


def _renamed(state: dict, to_module: bool = True) -> dict:
    """A state dict with diffusers' `blocks.<i>` keys as the module's `transformer_blocks.<i>`
    (`to_module`), or back."""
    old, new = BLOCK_PREFIX if to_module else BLOCK_PREFIX[::-1]
    return {new + k[len(old) :] if k.startswith(old) else k: v for k, v in state.items()}


class WanFamily(Family):
    name = "wan"
    denoiser_folder = "transformer"
    denoiser_classes = CLASS_NAMES
    pipeline_classes = ("WanPipeline",)
    presets = _presets.PRESETS
    full_size = _presets.FULL_SIZE
    weighted = _presets.WEIGHTED
    default_guidance = 5.0  # diffusers' WanPipeline
    default_sampler = "unipc"  # Wan's flow UniPC (UniPCMultistepScheduler, use_flow_sigmas)
    video = True

    def denoiser(self, config, where, dtype=jnp.float32, attention=None) -> WanFn:
        return wan_denoiser(config, None, dtype, where, attention or AttentionSpec())

    def load_denoiser(self, path: Path, dtype, attention: AttentionSpec):
        """(fn, params): the checkpoint's `blocks.<i>` are the module's `transformer_blocks`."""
        from patchpar.models.loading import read_state_dict, state_dict_to_params

        fn = self.denoiser(read_config(path), f"{path}/config.json", dtype, attention)
        state = _renamed(read_state_dict(path))
        return fn, state_dict_to_params(state, fn.abstract_params(), str(path), dtype=dtype)

    def is_large(self, config: dict) -> bool:
        return config.get("num_attention_heads", 40) * config.get("attention_head_dim", 128) >= 1024

    def vae_factor(self, config: dict) -> int:
        """The config's `scale_factor_spatial` (what diffusers reads; Wan 2.2's 16x VAE), else
        its upsamplings' (x its patch size)."""
        return int(
            config.get("scale_factor_spatial")
            or 2 ** (len(config.get("dim_mult", (1, 2, 4, 4))) - 1)
            * (config.get("patch_size") or 1)
        )

    def vae_temporal(self, config: dict) -> int:
        down = config.get("temperal_downsample", (False, True, True))
        return int(config.get("scale_factor_temporal") or 2 ** sum(map(bool, down)))

    def load_vae(self, path: Path, dtype, attention: AttentionSpec):
        del attention  # the middle block's per-frame attention runs the site's default
        return load_wan_vae(path, dtype)

    def abstract_vae(self, config: dict, dtype) -> WanVAEFn:
        return WanVAEFn(WanVAEDecoder(WanVAEConfig.from_diffusers(config), dtype))

    def check_index(self, index: dict) -> None:
        max_sequence_length(index, 512, "WanPipeline")
        self.second_expert(index)

    def second_expert(self, index: dict) -> tuple[str, float] | None:
        """Wan 2.2 A14B's low-noise expert: `transformer_2` where `boundary_ratio` is set (without
        it WanPipeline runs `transformer` alone, and so does patchpar); a ratio without a
        second transformer: ValueError."""
        from patchpar.sampling.experts import check_boundary_ratio

        second = index.get("transformer_2")  # [library, class], or [null, null]: none
        ratio = index.get("boundary_ratio")
        if ratio is None:
            return None
        ratio = check_boundary_ratio(ratio)
        if not (second and any(second)):
            raise ValueError(
                f"boundary_ratio={ratio} in model_index.json names a switch to a low-noise expert, "
                f"but the pipeline has no transformer_2 (got {second!r}); add transformer_2/ and "
                f"its entry, or drop boundary_ratio"
            )
        return "transformer_2", ratio

    def load_text(self, folder: Path, index: dict, dtype) -> UMT5Conditioning:
        from patchpar.models.components import load_t5_encoder
        from patchpar.models.tokenizer import T5Tokenizer

        tokens = max_sequence_length(index, 512, "WanPipeline")
        for sub in ("text_encoder", "tokenizer"):
            if not (folder / sub).is_dir():
                raise CheckpointError(
                    f"{str(folder)!r}: a Wan pipeline needs {sub}/ (umT5); it is missing"
                )
        encoder = load_t5_encoder(folder / "text_encoder", dtype)
        return UMT5Conditioning([encoder], [T5Tokenizer(folder / "tokenizer", lower=False)],
                                tokens)  # fmt: skip

    def text_programs(self, component, batch: int, dtype):
        from patchpar.models.t5 import T5Config, T5EncoderModel

        cfg = component("text_encoder")
        if cfg is None:
            return []
        module = T5EncoderModel(T5Config.from_transformers(cfg, "text_encoder"), dtype)
        tokens = (component("pipeline") or {}).get("max_sequence_length", 512)
        return [(module, jax.ShapeDtypeStruct((batch, tokens), jnp.int32))]

    def write_random_folder(self, folder: Path, preset: dict, seed: int) -> None:
        """A Wan pipeline folder: transformer/ (diffusers' key names), vae/ (the decoder's
        weights: patchpar decodes only), a umT5 text_encoder/ and its sentencepiece tokenizer/
        (trained here on a few captions), scheduler/, model_index.json."""
        from patchpar.models.components import T5EncoderFn
        from patchpar.models.configs import TOKENIZER_TEXT
        from patchpar.models.loading import write_component, write_scheduler
        from patchpar.models.t5 import T5Config, T5EncoderModel
        from patchpar.models.tokenizer import write_t5_tokenizer

        folder = Path(folder)
        fn = self.denoiser(preset["transformer"], "transformer")
        write_component(folder / "transformer", preset["transformer"], fn.init(seed),
                        lambda state: _renamed(state, to_module=False))  # fmt: skip
        if "vae" in preset:  # none: a pixel-space model (its latent is the video)
            vae = WanVAEFn(WanVAEDecoder(WanVAEConfig.from_diffusers(preset["vae"])))
            write_component(folder / "vae", preset["vae"], vae.init(seed + 1))
        t5_cfg = preset["text_encoder"]
        t5 = T5EncoderFn(T5EncoderModel(T5Config.from_transformers(t5_cfg)))
        write_component(folder / "text_encoder", t5_cfg, t5.init(seed + 2))
        write_t5_tokenizer(folder / "tokenizer", TOKENIZER_TEXT, vocab_size=t5_cfg["vocab_size"])
        write_scheduler(folder, preset["scheduler"])
        index = {
            "_class_name": preset["pipeline"]["_class_name"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "scheduler": ["diffusers", preset["scheduler"]["_class_name"]],
        }
        if "vae" not in preset:
            del index["vae"]
        extra = {k: v for k, v in preset["pipeline"].items() if k != "_class_name"}
        (folder / "model_index.json").write_text(json.dumps({**index, **extra}, indent=2))


FAMILY = WanFamily()

__all__ = [
    "FAMILY", "UMT5Conditioning", "Video", "WanConfig", "WanFn", "WanTransformer3DModel",
    "WanVAEFn", "load_wan_vae", "prompt_clean", "wan_denoiser",
]  # fmt: skip
