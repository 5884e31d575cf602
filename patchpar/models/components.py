"""The components every family shares, as `(apply_fn, params)` pairs: the VAE, the CLIP and T5
text encoders, and the helpers that build any component's parameters (abstract shapes,
deterministic random weights, loading a folder's state dict)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
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
from patchpar.models.sites import SiteOps
from patchpar.models.t5 import T5Config, T5EncoderModel
from patchpar.models.vae import AutoencoderKL, VAEConfig


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
        return abstract_init(self.module, x)

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
        return abstract_init(self.module, ids)

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
        return abstract_init(self.module, ids)

    def init(self, seed: int = 0):
        return random_params(self.abstract_params(), seed)


def abstract_init(module, *args, **kwargs):
    """Parameter shapes and dtypes without computing anything (works for full-size presets)."""
    init = lambda *a, **k: module.init(jax.random.key(0), *a, **k)["params"]  # noqa: E731
    return jax.eval_shape(init, *args, **kwargs)


SCALES = ("scale", "gamma")  # norm scales' leaf names (gamma: the Wan VAE's RMS norms)


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
        elif path[-1] in SCALES:
            value = np.ones(leaf.shape)
        else:
            value = np.zeros(leaf.shape)
        out[path] = jnp.asarray(value, leaf.dtype)
    return unflatten_dict(out)


def random_params_on_device(abstract, seed: int):
    """`random_params`' distributions (LeCun-normal kernels, unit-normal embeddings, unit norm
    scales, zero biases) drawn on the default device, not in NumPy: a full-size UNet's weights
    in seconds on an accelerator, where NumPy and the transfer take a minute. Leaves of one shape
    and kind are drawn as one array, leaf by leaf in a `lax.map` (XLA's RngBitGenerator: a small
    program, quick to compile; a leaf's float32 draw is the only temporary, so a 5B model's bf16
    weights fit a 16 GB chip), then cut into the leaves one group at a time (at most one group
    held twice). Deterministic for a seed and a backend; not the same values as `random_params`."""
    flat = flatten_dict(abstract)
    groups: dict[tuple, list] = {}
    for path in sorted(flat):
        leaf = flat[path]
        kind = path[-1] if path[-1] in ("kernel", "embedding") else "zero"
        kind = "scale" if path[-1] in SCALES else kind
        groups.setdefault((kind, tuple(leaf.shape), jnp.dtype(leaf.dtype).name), []).append(path)
    order = sorted(groups.items())

    def draw():
        keys = jax.random.split(jax.random.key(seed, impl="rbg"), len(order))
        drawn = []
        for key, ((kind, shape, dtype), paths) in zip(keys, order, strict=True):
            if kind in ("kernel", "embedding"):  # leaf by leaf: one leaf's float32 at a time
                std = 1 / np.sqrt(int(np.prod(shape[:-1]))) if kind == "kernel" else 1.0
                one = lambda k, s=shape, d=std, t=dtype: (  # noqa: E731
                    jax.random.normal(k, s, jnp.float32) * d
                ).astype(t)
                value = jax.lax.map(one, jax.random.split(key, len(paths)))
            else:
                value = jnp.full((len(paths), *shape), 1.0 if kind == "scale" else 0.0)
            drawn.append(value.astype(dtype))
        return drawn

    drawn = jax.jit(draw)()
    out = {}
    for i, (_, paths) in enumerate(order):
        group, drawn[i] = drawn[i], None
        out.update({path: group[j] for j, path in enumerate(paths)})
        del group
    return unflatten_dict(out)


def load_params(fn, path: Path, where: str, state_map=None):
    state = read_state_dict(path)
    if state_map:
        state = {state_map(k): v for k, v in state.items()}
    return state_dict_to_params(state, fn.abstract_params(), where, dtype=fn.module.dtype)


def load_vae(
    path: str | Path, dtype=jnp.float32, attention: AttentionSpec = AUTO
) -> tuple[VAEFn, dict]:
    attention = resolve(attention, dtype)
    path = component(path, "vae")
    fn = VAEFn(
        AutoencoderKL(
            VAEConfig.from_diffusers(read_config(path), f"{path}/config.json"),
            dtype,
            attn=attention,
        )
    )
    return fn, load_params(fn, path, str(path))


def load_text_encoder(
    path: str | Path, dtype=jnp.float32, subfolder: str = "text_encoder"
) -> tuple[TextEncoderFn, dict]:
    path = component(path, subfolder)
    fn = TextEncoderFn(
        CLIPTextModel(
            CLIPTextConfig.from_transformers(read_config(path), f"{path}/config.json"), dtype
        )
    )

    def rename(
        key: str,
    ) -> str:  # transformers 5 saves CLIPTextModel without the text_model. prefix
        return key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key

    return fn, load_params(fn, path, str(path), rename)


def load_t5_encoder(
    path: str | Path, dtype=jnp.float32, subfolder: str = "text_encoder"
) -> tuple[T5EncoderFn, dict]:
    """T5 encoder from a transformers folder (`T5EncoderModel`, or the encoder of a full T5)."""
    path = component(path, subfolder)
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


def component(path: str | Path, name: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist")
    if (path / name / "config.json").is_file():
        return path / name
    return path


@partial(jax.jit, static_argnums=(0,))
def encode_text(fn: TextEncoderFn | T5EncoderFn, params, ids, *mask):
    """A text encoder on token ids (and a mask), compiled once per encoder."""
    return fn(params, ids, *mask)
