"""Flax AutoencoderKL (diffusers layout, NHWC): encoder, decoder, scaling factor from config."""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec
from patchpar.models.layers import (
    Conv,
    Downsample2D,
    GroupNorm,
    ResnetBlock2D,
    Upsample2D,
    dense,
)
from patchpar.models.sites import IDENTITY, SiteOps

_REQUIRED = {
    "act_fn": "silu",
    "mid_block_add_attention": True,
    "latents_mean": None,
    "latents_std": None,
}


@dataclass(frozen=True)
class VAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    sample_size: int = 32  # pixels; diffusers' tiled decode uses it as the tile side
    shift_factor: float = 0.0  # latents = (mean - shift) x scale (FLUX's VAE; SD's: none)
    use_quant_conv: bool = True  # a 1x1 conv after the encoder (FLUX's VAE has none)
    use_post_quant_conv: bool = True  # a 1x1 conv before the decoder

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_diffusers(cls, cfg: dict, where: str = "vae/config.json") -> VAEConfig:
        for key, want in _REQUIRED.items():
            if cfg.get(key, want) != want:
                raise ValueError(
                    f"{where}: {key}={cfg[key]!r} is not supported (supported: {want!r})"
                )
        n = len(cfg["block_out_channels"])
        for key, want in (
            ("down_block_types", "DownEncoderBlock2D"),
            ("up_block_types", "UpDecoderBlock2D"),
        ):
            types = cfg.get(key, [want] * n)
            if list(types) != [want] * n:
                raise ValueError(f"{where}: {key}={list(types)} not supported: need {n} x {want!r}")
        return cls(
            in_channels=cfg.get("in_channels", 3),
            out_channels=cfg.get("out_channels", 3),
            latent_channels=cfg.get("latent_channels", 4),
            block_out_channels=tuple(cfg["block_out_channels"]),
            layers_per_block=cfg.get("layers_per_block", 2),
            norm_num_groups=cfg.get("norm_num_groups", 32),
            scaling_factor=cfg.get("scaling_factor", 0.18215),
            sample_size=_side(cfg.get("sample_size", 32)),
            shift_factor=float(cfg.get("shift_factor") or 0.0),
            use_quant_conv=bool(cfg.get("use_quant_conv", True)),
            use_post_quant_conv=bool(cfg.get("use_post_quant_conv", True)),
        )


def _side(size) -> int:
    """A config's sample_size: an int, or [h, w] (square tiles: the larger)."""
    return int(max(size)) if isinstance(size, list | tuple) else int(size)


class SpatialSelfAttention(nn.Module):
    """The VAE mid-block attention: GroupNorm, one head over all pixels, residual."""

    groups: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, h, W, C)
        b, h, w, c = x.shape
        y = GroupNorm(self.groups, 1e-6, self.dtype, self.ops, name="group_norm")(x).reshape(
            b, h * w, c
        )
        q = dense(c, "to_q", self.dtype)(y)
        k, v = dense(c, "to_k", self.dtype)(y), dense(c, "to_v", self.dtype)(y)
        y = dense(c, "to_out_0", self.dtype)(
            self.ops.self_attention(self, q, k, v, 1, self.attn, w)
        )
        return x + y.reshape(b, h, w, c)


class VAEMidBlock(nn.Module):
    channels: int
    groups: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(groups=self.groups, eps=1e-6, use_temb=False, dtype=self.dtype, ops=self.ops)
        x = ResnetBlock2D(self.channels, name="resnets_0", **kw)(x)
        x = SpatialSelfAttention(self.groups, self.dtype, self.ops, self.attn, name="attentions_0")(
            x
        )
        return ResnetBlock2D(self.channels, name="resnets_1", **kw)(x)


class VAEBlock(nn.Module):
    """DownEncoderBlock2D / UpDecoderBlock2D: resnets, then an optional down- or upsampler."""

    channels: int
    layers: int
    groups: int
    resample: str | None  # "down" (encoder), "up" (decoder) or None (last block)
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for j in range(self.layers):
            x = ResnetBlock2D(
                self.channels, self.groups, 1e-6, False, self.dtype, self.ops, name=f"resnets_{j}"
            )(x)
        if self.resample == "down":
            x = Downsample2D(self.channels, 0, self.dtype, self.ops, name="downsamplers_0")(x)
        elif self.resample == "up":
            x = Upsample2D(self.channels, self.dtype, self.ops, name="upsamplers_0")(x)
        return x


class Encoder(nn.Module):
    config: VAEConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, H, W, 3) -> (B, H/f, W/f, 2*latent)
        cfg, dt, ops = self.config, self.dtype, self.ops
        boc = cfg.block_out_channels
        x = Conv(boc[0], dtype=dt, ops=ops, name="conv_in")(x.astype(dt))
        for i, c in enumerate(boc):
            down = "down" if i < len(boc) - 1 else None
            x = VAEBlock(
                c, cfg.layers_per_block, cfg.norm_num_groups, down, dt, ops, name=f"down_blocks_{i}"
            )(x)
        x = VAEMidBlock(boc[-1], cfg.norm_num_groups, dt, ops, self.attn, name="mid_block")(x)
        x = nn.silu(GroupNorm(cfg.norm_num_groups, 1e-6, dt, ops, name="conv_norm_out")(x))
        return Conv(2 * cfg.latent_channels, dtype=dt, ops=ops, name="conv_out")(x)


class Decoder(nn.Module):
    config: VAEConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:  # (B, h, w, latent) -> (B, h*f, w*f, 3)
        cfg, dt, ops = self.config, self.dtype, self.ops
        boc = cfg.block_out_channels[::-1]
        x = Conv(boc[0], dtype=dt, ops=ops, name="conv_in")(z.astype(dt))
        x = VAEMidBlock(boc[0], cfg.norm_num_groups, dt, ops, self.attn, name="mid_block")(x)
        for i, c in enumerate(boc):
            up = "up" if i < len(boc) - 1 else None
            x = VAEBlock(
                c, cfg.layers_per_block + 1, cfg.norm_num_groups, up, dt, ops, name=f"up_blocks_{i}"
            )(x)
        x = nn.silu(GroupNorm(cfg.norm_num_groups, 1e-6, dt, ops, name="conv_norm_out")(x))
        return Conv(cfg.out_channels, dtype=dt, ops=ops, name="conv_out")(x)


class AutoencoderKL(nn.Module):
    """`encode` gives the latent distribution's (mean, logvar); `decode` maps a latent to an
    image in [-1, 1]. Scaling by `config.scaling_factor` (and shifting by `shift_factor`) is
    the pipeline's job, as in diffusers."""

    config: VAEConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    def setup(self):
        lc = self.config.latent_channels
        self.encoder = Encoder(self.config, self.dtype, self.ops, self.attn)
        self.decoder = Decoder(self.config, self.dtype, self.ops, self.attn)
        if self.config.use_quant_conv:
            self.quant_conv = Conv(2 * lc, 1, padding=0, dtype=self.dtype)
        if self.config.use_post_quant_conv:
            self.post_quant_conv = Conv(lc, 1, padding=0, dtype=self.dtype)

    def encode(
        self, images: jax.Array
    ) -> tuple[jax.Array, jax.Array]:  # (B,H,W,3) -> 2 x (B,h,w,lc)
        moments = self.encoder(images)
        if self.config.use_quant_conv:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode(self, latents: jax.Array) -> jax.Array:  # (B, h, w, lc) -> (B, H, W, 3)
        if self.config.use_post_quant_conv:
            latents = self.post_quant_conv(latents)
        return self.decoder(latents)

    def __call__(self, images: jax.Array) -> jax.Array:
        mean, _ = self.encode(images)
        return self.decode(mean)
