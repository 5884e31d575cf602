"""Loaded models as `(apply_fn, params)` pairs. Each apply_fn is a small frozen object that
keeps its Flax module (so the parallel layer can swap the site ops with `with_ops`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from patchpar.models.attention import AUTO, AttentionSpec, resolve
from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
from patchpar.models.loading import (
    CheckpointError,
    read_config,
    read_state_dict,
    state_dict_to_params,
)
from patchpar.models.pixart import CLASS_NAMES as PIXART_CLASSES
from patchpar.models.pixart import LOGICAL as PIXART_LOGICAL
from patchpar.models.pixart import UNSUPPORTED as UNSUPPORTED_DITS
from patchpar.models.pixart import PixArtConfig, PixArtStack, PixArtTransformer2DModel
from patchpar.models.sites import SiteOps
from patchpar.models.t5 import T5Config, T5EncoderModel
from patchpar.models.unet import LOGICAL as UNET_LOGICAL
from patchpar.models.unet import UNet2DConditionModel, UNetConfig
from patchpar.models.vae import AutoencoderKL, VAEConfig


@dataclass(frozen=True)
class UNetFn:
    """`unet_apply(params, sample, timesteps, encoder_hidden_states, text_embeds=, time_ids=)`."""

    module: UNet2DConditionModel
    family = "unet"
    logical = UNET_LOGICAL  # its parameters' logical axes (`parallel.rules`)

    @property
    def config(self) -> UNetConfig:
        return self.module.config

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

    stack = None  # no stack of identical blocks: its levels differ in width and resolution

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
            {"params": params}, sample, timesteps, encoder_hidden_states, **added_cond
        )

    def with_ops(self, ops: SiteOps) -> UNetFn:
        return replace(self, module=self.module.clone(ops=ops))

    def with_attention(self, spec: AttentionSpec) -> UNetFn:
        return replace(self, module=self.module.clone(attn=spec))

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
        return _abstract_init(self.module, *args, **added)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


@dataclass(frozen=True)
class PixArtFn:
    """`pixart_apply(params, sample (B, H, W, C), timesteps, encoder_hidden_states (B, S, Dt),
    encoder_attention_mask=None (B, S), added_cond_kwargs=None)` -> (B, H, W, out_channels);
    `added_cond_kwargs` holds `resolution` (B, 2) and `aspect_ratio` (B, 1) for a model with
    micro-conditions (diffusers' names throughout)."""

    module: PixArtTransformer2DModel
    family = "pixart"
    logical = PIXART_LOGICAL  # its parameters' logical axes (`parallel.rules`)

    @property
    def config(self) -> PixArtConfig:
        return self.module.config

    @property
    def row_multiple(self) -> int:
        """Latent rows of one patch must be a multiple of the patch size p: a row slab is then
        a contiguous run of whole tokens."""
        return self.config.patch_size

    @property
    def row_multiple_reason(self) -> str:
        return f"patch size {self.config.patch_size}"

    def prediction(self, out: jax.Array) -> jax.Array:
        """The sampler's model output from the network's: with learned sigma (twice the
        latent's channels) the first half, as diffusers' PixArt pipelines take it."""
        return out[..., : self.config.in_channels] if self.config.learned_sigma else out

    @property
    def stack(self) -> PixArtStack:
        """The model as input part, identical blocks and output part (for PipeFusion)."""
        m = self.module
        return PixArtStack(m.config, m.dtype, m.attn)

    def check_split(self, model: int) -> None:
        """Tensor parallel over `model` devices: the feed-forward's inner width divides (heads
        need not: they are padded with zero heads)."""
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
            {"params": params},
            sample,
            timesteps,
            encoder_hidden_states,
            encoder_attention_mask,
            added.get("resolution"),
            added.get("aspect_ratio"),
        )

    def with_ops(self, ops: SiteOps) -> PixArtFn:
        return replace(self, module=self.module.clone(ops=ops))

    def with_attention(self, spec: AttentionSpec) -> PixArtFn:
        return replace(self, module=self.module.clone(attn=spec))

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
        args, added = self.example_inputs(1, self.config.patch_size, seq=4)
        return _abstract_init(self.module, *args, **added)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


Denoiser = UNetFn | PixArtFn  # what the parallel engine runs (docs/design.md §1)


@dataclass(frozen=True)
class VAEFn:
    """`vae_apply(params, latents)` decodes (B,h,w,C) latents to (B,H,W,3) images in [-1, 1];
    `vae_apply.encode(params, images)` gives the latent distribution's (mean, logvar)."""

    module: AutoencoderKL

    @property
    def config(self) -> VAEConfig:
        return self.module.config

    def __call__(self, params, latents):
        return self.module.apply({"params": params}, latents, method=AutoencoderKL.decode)

    def encode(self, params, images):
        return self.module.apply({"params": params}, images, method=AutoencoderKL.encode)

    def with_ops(self, ops: SiteOps) -> VAEFn:
        return replace(self, module=self.module.clone(ops=ops))

    def with_attention(self, spec: AttentionSpec) -> VAEFn:
        return replace(self, module=self.module.clone(attn=spec))

    def abstract_params(self):
        x = jax.ShapeDtypeStruct(
            (
                1,
                self.config.downsample_factor,
                self.config.downsample_factor,
                self.config.in_channels,
            ),
            self.module.dtype,
        )
        return _abstract_init(self.module, x)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


@dataclass(frozen=True)
class TextEncoderFn:
    """`text_apply(params, input_ids (B, S))` -> dict with last_hidden_state, pooler_output,
    hidden_states and (with a projection) text_embeds."""

    module: CLIPTextModel

    @property
    def config(self) -> CLIPTextConfig:
        return self.module.config

    def __call__(self, params, input_ids):
        return self.module.apply({"params": params}, input_ids)

    def abstract_params(self):
        ids = jax.ShapeDtypeStruct((1, self.config.max_position_embeddings), jnp.int32)
        return _abstract_init(self.module, ids)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


@dataclass(frozen=True)
class T5EncoderFn:
    """`t5_apply(params, input_ids (B, S), attention_mask (B, S) | None)` -> dict with
    last_hidden_state (B, S, D)."""

    module: T5EncoderModel

    @property
    def config(self) -> T5Config:
        return self.module.config

    def __call__(self, params, input_ids, attention_mask=None):
        return self.module.apply({"params": params}, input_ids, attention_mask)

    def abstract_params(self):
        ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)  # the relative bias fits any length
        return _abstract_init(self.module, ids)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


def _abstract_init(module, *args, **kwargs):
    """Parameter shapes and dtypes without computing anything (works for full-size presets)."""
    init = lambda *a, **k: module.init(jax.random.key(0), *a, **k)["params"]  # noqa: E731
    return jax.eval_shape(init, *args, **kwargs)


def random_params(abstract, seed: int):
    """Deterministic random weights for an abstract parameter tree, drawn with NumPy (compiling a
    Flax init of a UNet takes tens of seconds on CPU): LeCun-normal kernels, unit-normal
    embeddings, unit norm scales, zero biases."""
    rng = np.random.default_rng(seed)
    flat = flatten_dict(abstract)
    out = {}
    for path in sorted(flat):
        leaf = flat[path]
        if path[-1] == "kernel":
            fan_in = int(np.prod(leaf.shape[:-1]))
            value = rng.standard_normal(leaf.shape) / np.sqrt(fan_in)
        elif path[-1] == "embedding":
            value = rng.standard_normal(leaf.shape)
        elif path[-1] == "scale":
            value = np.ones(leaf.shape)
        else:
            value = np.zeros(leaf.shape)
        out[path] = jnp.asarray(value, leaf.dtype)
    return unflatten_dict(out)


def _load(fn, path: Path, where: str, state_map=None):
    state = read_state_dict(path)
    if state_map:
        state = {state_map(k): v for k, v in state.items()}
    return state_dict_to_params(state, fn.abstract_params(), where, dtype=fn.module.dtype)


def load_unet(
    path: str | Path, dtype=jnp.float32, attention: AttentionSpec = AUTO
) -> tuple[UNetFn, dict]:
    """UNet from a diffusers folder (`.../unet` or a pipeline folder holding `unet/`).
    `attention` is resolved for this backend and dtype first (an unavailable kernel raises)."""
    attention = resolve(attention, dtype)
    path = _component(path, "unet")
    fn = UNetFn(
        UNet2DConditionModel(
            UNetConfig.from_diffusers(read_config(path), f"{path}/config.json"),
            dtype,
            attn=attention,
        )
    )
    return fn, _load(fn, path, str(path))


def load_pixart(
    path: str | Path, dtype=jnp.float32, attention: AttentionSpec = AUTO
) -> tuple[PixArtFn, dict]:
    """PixArt-α/Σ transformer from a diffusers folder (`.../transformer` or a pipeline folder
    holding `transformer/`)."""
    attention = resolve(attention, dtype)
    path = _component(path, "transformer")
    config = PixArtConfig.from_diffusers(read_config(path), f"{path}/config.json")
    fn = PixArtFn(PixArtTransformer2DModel(config, dtype, attn=attention))
    return fn, _load(fn, path, str(path))


def load_vae(
    path: str | Path, dtype=jnp.float32, attention: AttentionSpec = AUTO
) -> tuple[VAEFn, dict]:
    attention = resolve(attention, dtype)
    path = _component(path, "vae")
    fn = VAEFn(
        AutoencoderKL(
            VAEConfig.from_diffusers(read_config(path), f"{path}/config.json"),
            dtype,
            attn=attention,
        )
    )
    return fn, _load(fn, path, str(path))


def load_text_encoder(
    path: str | Path, dtype=jnp.float32, subfolder: str = "text_encoder"
) -> tuple[TextEncoderFn, dict]:
    path = _component(path, subfolder)
    fn = TextEncoderFn(
        CLIPTextModel(
            CLIPTextConfig.from_transformers(read_config(path), f"{path}/config.json"), dtype
        )
    )

    def rename(
        key: str,
    ) -> str:  # transformers 5 saves CLIPTextModel without the text_model. prefix
        return key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key

    return fn, _load(fn, path, str(path), rename)


def load_t5_encoder(
    path: str | Path, dtype=jnp.float32, subfolder: str = "text_encoder"
) -> tuple[T5EncoderFn, dict]:
    """T5 encoder from a transformers folder (`T5EncoderModel`, or the encoder of a full T5)."""
    path = _component(path, subfolder)
    where = f"{path}/config.json"
    fn = T5EncoderFn(T5EncoderModel(T5Config.from_transformers(read_config(path), where), dtype))
    state = read_state_dict(path)
    # the token embedding is tied: saved as `shared`, as `encoder.embed_tokens`, or both
    tied = state.pop("encoder.embed_tokens.weight", None)
    if "shared.weight" not in state and tied is not None:
        state["shared.weight"] = tied
    state = {k: v for k, v in state.items() if not k.startswith(("decoder.", "lm_head."))}
    params = state_dict_to_params(state, fn.abstract_params(), str(path), dtype=dtype)
    return fn, params


def load_denoiser(
    path: str | Path, dtype=jnp.float32, attention: AttentionSpec = AUTO
) -> tuple[UNetFn | PixArtFn, dict]:
    """The denoiser of a diffusers folder, `(fn, params)`: a UNet (`unet/`) or a PixArt
    transformer (`transformer/`) of a pipeline folder, or such a component folder itself.
    Every fn takes `(params, sample (B, H, W, C), timesteps, encoder_hidden_states, ...)` and
    has `row_multiple`, `example_inputs`, `abstract_params`, `check_split`, `with_ops` and
    `logical` (its parameters' logical axes)."""
    path = Path(path)
    if (path / "transformer" / "config.json").is_file():
        return load_pixart(path, dtype, attention)
    if (path / "unet" / "config.json").is_file():
        return load_unet(path, dtype, attention)
    name = read_config(path).get("_class_name")
    if name == "UNet2DConditionModel":
        return load_unet(path, dtype, attention)
    if name in PIXART_CLASSES or name in UNSUPPORTED_DITS:
        return load_pixart(path, dtype, attention)  # an unsupported family is named there
    raise CheckpointError(
        f"{str(path)!r}: _class_name={name!r} is not a denoiser patchpar runs (supported: "
        f"UNet2DConditionModel, {', '.join(PIXART_CLASSES)}); a pipeline folder holds unet/ "
        f"or transformer/"
    )


def _component(path: str | Path, name: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist")
    if (path / name / "config.json").is_file():
        return path / name
    return path
