"""Flax decoder of Wan's video VAE (diffusers' `AutoencoderKLWan`): latents (B, F, h, w, z_dim)
-> frames (B, 1 + 4 (F - 1), 8h, 8w, 3) in [-1, 1] (Wan 2.1), or 16h x 16w (Wan 2.2 TI2V-5B's
residual VAE: each up block adds a shortcut that repeats its input's channels into the upsampled
frames and pixels, and the decoder's 12 channels are 2 x 2 pixels of RGB, `patch_size` 2).

Its convolutions are causal in time: a 3 x 3 x 3 convolution sees its frame and the two before
it (zeros before the first). diffusers decodes one latent frame at a time, each convolution
keeping the last two frames of its input as a cache for the next chunk (`feat_cache`); here the
same, as a Flax collection `cache` carried through a `lax.scan` over the latent frames after the
first: the arithmetic is diffusers' chunk for chunk, and only one latent frame's activations
live at a time. A temporal upsampling (`upsample3d`) passes the first latent frame on without
its time convolution (diffusers' "Rep"): frame 0 decodes to one frame, every later latent frame
to 4. Spatial padding goes through the site `ops.halo` (the rows of a row patch's neighbours;
zeros on one device); the attention of the middle block is per frame, over the frame's pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from patchpar.models.attention import AUTO
from patchpar.models.sites import IDENTITY, SiteOps

CACHE = "cache"  # Flax collection: each causal convolution's last frames of its input
CLASS_NAMES = ("AutoencoderKLWan",)


@dataclass(frozen=True)
class WanVAEConfig:
    """The decoder's part of a diffusers AutoencoderKLWan config.json."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    out_channels: int = 3
    is_residual: bool = False  # Wan 2.2's up blocks with a channel-repeating shortcut
    patch_size: int | None = None  # the decoder's output: patch x patch pixels per position
    latents_mean: tuple[float, ...] = ()
    latents_std: tuple[float, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def temperal_upsample(self) -> tuple[bool, ...]:
        return tuple(self.temperal_downsample[::-1])

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1) * (self.patch_size or 1)

    @property
    def downsample_factor(self) -> int:
        """Image pixels per latent pixel (the image VAE's name for `spatial_factor`)."""
        return self.spatial_factor

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.temperal_downsample)

    @classmethod
    def from_diffusers(cls, cfg: dict, where: str = "vae/config.json") -> WanVAEConfig:
        name = cfg.get("_class_name", CLASS_NAMES[0])
        if name not in CLASS_NAMES:
            raise ValueError(f"{where}: _class_name={name!r} is not a Wan VAE {list(CLASS_NAMES)}")
        if cfg.get("attn_scales", []) not in ([], ()):
            raise ValueError(
                f"{where}: attn_scales={cfg['attn_scales']!r} is not supported (Wan's VAEs have "
                f"none: attention in the middle block only)"
            )
        patch, out = cfg.get("patch_size"), cfg.get("out_channels", 3)
        if patch is not None and (not isinstance(patch, int) or patch < 1 or out % (patch * patch)):
            raise ValueError(
                f"{where}: patch_size={patch!r} with out_channels={out}: the decoder's channels "
                f"must be whole patch x patch pixels of each output channel (Wan 2.2: 2 and 12)"
            )
        dec = cfg.get("decoder_base_dim")
        return cls(
            base_dim=dec if dec is not None else cfg.get("base_dim", 96),
            z_dim=cfg.get("z_dim", 16),
            dim_mult=tuple(cfg.get("dim_mult", (1, 2, 4, 4))),
            num_res_blocks=cfg.get("num_res_blocks", 2),
            temperal_downsample=tuple(cfg.get("temperal_downsample", (False, True, True))),
            out_channels=out,
            is_residual=bool(cfg.get("is_residual", False)),
            patch_size=None if patch in (None, 1) else patch,
            latents_mean=tuple(cfg.get("latents_mean", ())),
            latents_std=tuple(cfg.get("latents_std", ())),
            extra=dict(cfg),
        )


def _conv(x, kernel, bias, strides=None):
    """NDHWC (or NHWC) convolution, VALID, of a DHWIO (HWIO) kernel, plus bias."""
    nd = kernel.ndim - 2
    dims = ("NDHWC", "DHWIO", "NDHWC") if nd == 3 else ("NHWC", "HWIO", "NHWC")
    y = lax.conv_general_dilated(x, kernel.astype(x.dtype), strides or (1,) * nd, "VALID",
                                 dimension_numbers=dims)  # fmt: skip
    return y + bias.astype(x.dtype)


def _padded(mod, x: jax.Array, p: int) -> jax.Array:
    """(N, h, W, C) frames with `p` rows of the neighbours above and below (the halo site; zeros
    on one device) and `p` zero columns each side."""
    x = mod.ops.halo(mod, x, p, p)
    return jnp.pad(x, ((0, 0), (0, 0), (p, p), (0, 0)))


class CausalConv3d(nn.Module):
    """WanCausalConv3d: a (kt, k, k) convolution, causal in time (its input's last kt - 1
    frames kept in the `cache` collection for the next chunk; zeros before the first), its
    spatial padding through the halo site."""

    features: int
    kernel: tuple[int, int, int] = (3, 3, 3)
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, t, h, W, C) -> (B, t, h, W, F)
        kt, kh, kw = self.kernel
        c = x.shape[-1]
        init = nn.initializers.lecun_normal()
        kernel = self.param("kernel", init, (kt, kh, kw, c, self.features), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        if kt > 1:  # the last frames of the input before this chunk's
            shape = (x.shape[0], kt - 1) + x.shape[2:]
            cache = self.variable(CACHE, "frames", jnp.zeros, shape, x.dtype)
            x = jnp.concatenate([cache.value.astype(x.dtype), x], axis=1)
            if not self.is_initializing():
                cache.value = x[:, -(kt - 1) :]
        if kh > 1:  # rows through the site (folded over frames), columns zero
            b, t = x.shape[:2]
            x = _padded(self, x.reshape(b * t, *x.shape[2:]), kh // 2)
            x = x.reshape(b, t, *x.shape[1:])
        return _conv(x, kernel, bias)


class RMSNorm(nn.Module):
    """WanRMS_norm: x / ||x|| over channels x sqrt(C) x gamma (gamma kept in the checkpoint's
    shape, (C, 1, 1[, 1])); float32 inside."""

    images: bool = False  # gamma (C, 1, 1) (per frame) rather than (C, 1, 1, 1)
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        shape = (c, 1, 1) if self.images else (c, 1, 1, 1)
        gamma = self.param("gamma", nn.initializers.ones, shape, self.dtype)
        xf = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True))
        y = xf / jnp.maximum(norm, 1e-12) * (c**0.5) * gamma.reshape(c).astype(jnp.float32)
        return y.astype(x.dtype)


class ResidualBlock(nn.Module):
    """WanResidualBlock: norm, SiLU, causal conv, twice, plus the (1x1x1) shortcut."""

    features: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dt, ops = self.dtype, self.ops
        h = x
        if x.shape[-1] != self.features:
            h = CausalConv3d(self.features, (1, 1, 1), dt, ops, name="conv_shortcut")(x)
        x = nn.silu(RMSNorm(False, dt, name="norm1")(x))
        x = CausalConv3d(self.features, (3, 3, 3), dt, ops, name="conv1")(x)
        x = nn.silu(RMSNorm(False, dt, name="norm2")(x))
        x = CausalConv3d(self.features, (3, 3, 3), dt, ops, name="conv2")(x)
        return x + h


class AttentionBlock(nn.Module):
    """WanAttentionBlock: one head over each frame's pixels (per frame, not across time)."""

    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, h, w, c = x.shape
        y = RMSNorm(True, self.dtype, name="norm")(x).reshape(b * t, h, w, c)
        qkv = nn.Conv(3 * c, (1, 1), dtype=self.dtype, param_dtype=self.dtype, name="to_qkv")(y)
        q, k, v = (a.reshape(b * t, h * w, c) for a in jnp.split(qkv, 3, axis=-1))
        out = self.ops.self_attention(self, q, k, v, 1, AUTO, w)  # one head
        out = nn.Conv(c, (1, 1), dtype=self.dtype, param_dtype=self.dtype, name="proj")(
            out.reshape(b * t, h, w, c)
        )
        return x + out.reshape(b, t, h, w, c)


class Resample(nn.Module):
    """WanResample, upsampling: `upsample3d` first doubles the frames by its causal time
    convolution (channels to 2C, split into two frames in turn; not on the first chunk), then
    every frame is upsampled 2x (nearest) and convolved (3 x 3) to C / 2 channels."""

    mode: str  # upsample2d | upsample3d
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    features: int | None = None  # the convolution's output channels (None: half the input's)

    @nn.compact
    def __call__(self, x: jax.Array, first: bool) -> jax.Array:
        b, t, h, w, c = x.shape
        if self.mode == "upsample3d":
            conv = CausalConv3d(2 * c, (3, 1, 1), self.dtype, self.ops, name="time_conv")
            if first:  # diffusers' "Rep": no time convolution; its cache starts at zeros
                conv(jnp.zeros((b, 0, h, w, c), x.dtype))  # (its parameters and zero cache)
            else:
                y = conv(x).reshape(b, t, h, w, 2, c)
                x = jnp.moveaxis(y, 4, 2).reshape(b, 2 * t, h, w, c)
                t = 2 * t
        x = jnp.repeat(jnp.repeat(x.reshape(b * t, h, w, c), 2, axis=1), 2, axis=2)
        x = _padded(self, x, 1)
        out = c // 2 if self.features is None else self.features
        conv = nn.Conv(out, (3, 3), padding="VALID", dtype=self.dtype, param_dtype=self.dtype,
                       name="resample_1")  # fmt: skip
        y = conv(x)
        return y.reshape(b, t, *y.shape[1:])


class MidBlock(nn.Module):
    """WanMidBlock: a residual block, the per-frame attention, a residual block."""

    features: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dt, ops = self.dtype, self.ops
        x = ResidualBlock(self.features, dt, ops, name="resnets_0")(x)
        x = AttentionBlock(dt, ops, name="attentions_0")(x)
        return ResidualBlock(self.features, dt, ops, name="resnets_1")(x)


class UpBlock(nn.Module):
    features: int
    num_res_blocks: int
    mode: str | None
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array, first: bool) -> jax.Array:
        for i in range(self.num_res_blocks + 1):
            x = ResidualBlock(self.features, self.dtype, self.ops, name=f"resnets_{i}")(x)
        if self.mode is not None:
            x = Resample(self.mode, self.dtype, self.ops, name="upsamplers_0")(x, first)
        return x


class ResidualUpBlock(nn.Module):
    """WanResidualUpBlock (Wan 2.2): residual blocks, then (`up`) the upsampling to `features`
    channels, plus the shortcut `dup_up` of the block's input."""

    features: int
    num_res_blocks: int
    up: bool
    temporal: bool
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array, first: bool) -> jax.Array:
        shortcut = x
        for i in range(self.num_res_blocks + 1):
            x = ResidualBlock(self.features, self.dtype, self.ops, name=f"resnets_{i}")(x)
        if not self.up:
            return x
        mode = "upsample3d" if self.temporal else "upsample2d"
        x = Resample(mode, self.dtype, self.ops, self.features, name="upsampler")(x, first)
        return x + dup_up(shortcut, self.features, 2 if self.temporal else 1, 2, first)


def dup_up(x: jax.Array, features: int, ft: int, fs: int, first: bool) -> jax.Array:
    """diffusers' DupUp3D: (B, t, h, w, C) -> (B, ft t, fs h, fs w, features), each input
    channel repeated (features x ft x fs^2 / C times, in place) and the copies laid out as the
    output channel's ft frames and fs x fs pixels; the first chunk keeps its last frame of ft."""
    b, t, h, w, c = x.shape
    x = jnp.repeat(x, features * ft * fs * fs // c, axis=-1)
    x = x.reshape(b, t, h, w, features, ft, fs, fs)
    x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, t * ft, h * fs, w * fs, features)
    return x[:, ft - 1 :] if first else x


def unpatchify(x: jax.Array, p: int | None) -> jax.Array:
    """diffusers' unpatchify: (B, T, h, w, C p^2) -> (B, T, p h, p w, C), channel c x p^2 +
    j x p + i going to row offset i and column offset j."""
    if p is None:
        return x
    b, t, h, w, cp = x.shape
    x = x.reshape(b, t, h, w, cp // (p * p), p, p)  # (..., c, j: column, i: row)
    return x.transpose(0, 1, 2, 6, 3, 5, 4).reshape(b, t, h * p, w * p, cp // (p * p))


class WanDecoder3d(nn.Module):
    """diffusers WanDecoder3d on one chunk (B, t, h, w, z_dim); `first`: the first chunk."""

    config: WanVAEConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array, first: bool) -> jax.Array:
        cfg, dt, ops = self.config, self.dtype, self.ops
        mult = cfg.dim_mult
        dims = [cfg.base_dim * u for u in [mult[-1], *mult[::-1]]]
        x = CausalConv3d(dims[0], (3, 3, 3), dt, ops, name="conv_in")(x)
        x = MidBlock(dims[0], dt, ops, name="mid_block")(x)
        for i, out_dim in enumerate(dims[1:]):
            up = i != len(mult) - 1
            temporal = up and cfg.temperal_upsample[i]
            name = f"up_blocks_{i}"
            if cfg.is_residual:
                block = ResidualUpBlock(
                    out_dim, cfg.num_res_blocks, up, temporal, dt, ops, name=name
                )
            else:
                mode = None if not up else ("upsample3d" if temporal else "upsample2d")
                block = UpBlock(out_dim, cfg.num_res_blocks, mode, dt, ops, name=name)
            x = block(x, first)
        x = nn.silu(RMSNorm(False, dt, name="norm_out")(x))
        return CausalConv3d(cfg.out_channels, (3, 3, 3), dt, ops, name="conv_out")(x)


class WanVAEDecoder(nn.Module):
    """`post_quant_conv` and the decoder, chunk by chunk (module docstring)."""

    config: WanVAEConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    def setup(self):
        self.post_quant_conv = CausalConv3d(self.config.z_dim, (1, 1, 1), self.dtype, self.ops)
        self.decoder = WanDecoder3d(self.config, self.dtype, self.ops)

    def chunk(self, z: jax.Array, first: bool) -> jax.Array:
        return self.decoder(self.post_quant_conv(z), first)

    def __call__(self, z: jax.Array) -> jax.Array:  # (B, F, h, w, z) -> (B, F', H, W, 3)
        return self.chunk(z[:, :1], True)


def decode(module: WanVAEDecoder, params, z: jax.Array) -> jax.Array:
    """Latents (B, F, h, w, z_dim), already un-normalised (z / std + mean) -> frames
    (B, 1 + 4 (F - 1), 8h, 8w, 3) (16h x 16w for Wan 2.2's) clipped to [-1, 1]: the first
    latent frame, then a scan over the others carrying the causal caches."""
    variables = {"params": params}
    patch = module.config.patch_size
    first, state = module.apply(variables, z[:, :1], True, method="chunk", mutable=[CACHE])
    if z.shape[1] == 1:
        return jnp.clip(unpatchify(first, patch), -1.0, 1.0)

    def one(cache, zt):
        out, new = module.apply({**variables, **cache}, zt[:, None], False, method="chunk",
                                mutable=[CACHE])  # fmt: skip
        return new, out

    _, rest = lax.scan(one, state, jnp.moveaxis(z[:, 1:], 1, 0))  # (F-1, B, 4, h', w', C out)
    rest = jnp.moveaxis(rest, 0, 1)
    rest = rest.reshape(rest.shape[0], -1, *rest.shape[3:])
    return jnp.clip(unpatchify(jnp.concatenate([first, rest], axis=1), patch), -1.0, 1.0)
