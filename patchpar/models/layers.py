"""Building blocks shared by the UNet, the VAE and the transformers, named as in diffusers so
that checkpoints map onto them key by key (`down_blocks.0.resnets.1.conv1.weight` ->
`down_blocks_0/resnets_1/conv1/kernel`). Images are NHWC; the spatial sites go through `ops`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models.attention import AUTO, AttentionSpec, attend
from patchpar.models.sites import IDENTITY, SiteOps


class Conv(nn.Module):
    """2-D convolution with diffusers' padding; row halos come from `ops.halo`.

    `padding` is the symmetric zero padding of the PyTorch conv. `asym_pad=True` is the VAE
    encoder's downsampler: pad one row/column at the bottom/right only, then convolve unpadded.
    """

    features: int
    kernel_size: int = 3
    stride: int = 1
    padding: int = 1
    asym_pad: bool = False
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    row_split: bool = False  # tensor parallel: Cin is this device's share; sum, then the bias

    @nn.compact
    def __call__(
        self, x: jax.Array
    ) -> jax.Array:  # (B, h, W, Cin) -> (B, h/stride, W/stride, Cout)
        k = self.kernel_size
        kernel = self.param(
            "kernel", nn.initializers.lecun_normal(), (k, k, x.shape[-1], self.features), self.dtype
        )
        if self.asym_pad:
            top, bottom, cols = 0, 1, (0, 1)
        else:
            top = bottom = self.padding
            cols = (self.padding, self.padding)
        if k > 1 or top or bottom:
            x = self.ops.halo(self, x, top, bottom)  # (B, top + h + bottom, W, Cin)
        y = jax.lax.conv_general_dilated(
            x.astype(self.dtype),
            kernel,
            window_strides=(self.stride, self.stride),
            padding=((0, 0), cols),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        if self.row_split and self.ops.model_degree() > 1:
            y = self.ops.model_sum(self, y)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class GroupNorm(nn.Module):
    """GroupNorm over (rows, cols, channels-in-group); global statistics via `ops.group_stats`."""

    num_groups: int = 32
    epsilon: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, h, W, C)
        b, h, w, c = x.shape
        g = self.num_groups
        if c % g:
            raise ValueError(f"GroupNorm: {c} channels are not divisible into {g} groups")
        xg = x.astype(jnp.float32).reshape(b, h, w, g, c // g)
        own = self.ops.own_rows(h)  # uneven patches: the rows after this patch's are padding
        if own is None:
            mean = xg.mean(axis=(1, 2, 4))  # (B, G)
            mean_sq = jnp.square(xg).mean(axis=(1, 2, 4))  # (B, G)
        else:
            mine = jnp.where((jnp.arange(h) < own)[None, :, None, None, None], xg, 0.0)
            count = (own * w * (c // g)).astype(jnp.float32)
            mean = mine.sum(axis=(1, 2, 4)) / count
            mean_sq = jnp.square(mine).sum(axis=(1, 2, 4)) / count
        mean, mean_sq = self.ops.group_stats(self, mean, mean_sq)
        var = jnp.maximum(mean_sq - jnp.square(mean), 0.0)
        xg = (xg - mean[:, None, None, :, None]) * jax.lax.rsqrt(var + self.epsilon)[
            :, None, None, :, None
        ]
        scale = self.param("scale", nn.initializers.ones, (c,), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (c,), self.dtype)
        return (xg.reshape(b, h, w, c) * scale + bias).astype(self.dtype)


def dense(features: int, name: str, dtype, use_bias: bool = True, ops: SiteOps | None = None):
    """A linear layer named as diffusers'. With `ops` splitting weights over the model axis it
    is row-split (its input is this device's share of the features): `RowDense`."""
    if ops is not None and ops.model_degree() > 1:
        return RowDense(features, use_bias, dtype, ops, name=name)
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


class RowDense(nn.Module):
    """Tensor parallel: x (..., Din / m) @ kernel (Din / m, Dout), summed over the model axis,
    then the bias (whole on every device). Parameters named as nn.Dense's."""

    features: int
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.lecun_normal()
        kernel = self.param("kernel", init, (x.shape[-1], self.features), self.dtype)
        y = self.ops.model_sum(self, jnp.dot(x.astype(self.dtype), kernel))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


# Logical axes of Attention's parameters (path pattern, one name per dimension; the parallel
# layer's rules map them to mesh axes): heads split under tensor parallelism, `embed` the width
# each projection reads or writes whole.
ATTENTION_AXES: tuple[tuple[str, tuple], ...] = (
    (r"attn[12]/to_[qkv]/kernel$", ("embed", "heads")),
    (r"attn[12]/to_[qkv]/bias$", ("heads",)),
    (r"attn[12]/to_out_0/kernel$", ("heads", "embed")),
)


class Attention(nn.Module):
    """diffusers `Attention`: to_q/to_k/to_v/to_out.0. Self-attention goes through the site."""

    heads: int
    dim_head: int
    out_dim: int
    qkv_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        context: jax.Array | None = None,
        context_mask: jax.Array | None = None,
        row: int | None = None,
    ) -> jax.Array:
        # x (B, T, C), context (B, S, Cc), context_mask (B, S) bool: real tokens; row: tokens
        # per image row of x (self-attention's site may keep whole rows)
        # tensor parallel: this device's heads (zero heads pad a count that does not divide)
        heads = -(-self.heads // self.ops.model_degree())
        inner = heads * self.dim_head
        q = dense(inner, "to_q", self.dtype, self.qkv_bias)(x)
        src = x if context is None else context
        k = dense(inner, "to_k", self.dtype, self.qkv_bias)(src)
        v = dense(inner, "to_v", self.dtype, self.qkv_bias)(src)
        if context is None:  # the site: whole-image keys/values (or context parallel)
            out = self.ops.self_attention(self, q, k, v, heads, self.attn, row)
        else:
            out = attend(self.attn, q, k, v, heads, context_mask)
        return dense(self.out_dim, "to_out_0", self.dtype, ops=self.ops)(out)


class ResnetBlock2D(nn.Module):
    """diffusers `ResnetBlock2D` (time-scale-shift 'default', SiLU, output scale 1)."""

    out_channels: int
    groups: int = 32
    eps: float = 1e-5
    use_temb: bool = True
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array | None = None) -> jax.Array:  # (B, h, W, C)
        kw = dict(dtype=self.dtype, ops=self.ops)
        m = self.ops.model_degree()  # tensor parallel: this device's share of the middle width
        h = nn.silu(GroupNorm(self.groups, self.eps, name="norm1", **kw)(x))
        h = Conv(self.out_channels // m, name="conv1", **kw)(h)  # (B, h, W, Cout / m)
        if self.use_temb:
            t = dense(self.out_channels // m, "time_emb_proj", self.dtype)(nn.silu(temb))
            h = h + t[:, None, None, :]
        h = nn.silu(GroupNorm(self.groups // m, self.eps, name="norm2", **kw)(h))
        h = Conv(self.out_channels, name="conv2", row_split=True, **kw)(h)
        if x.shape[-1] != self.out_channels:
            x = Conv(self.out_channels, kernel_size=1, padding=0, name="conv_shortcut", **kw)(x)
        return x + h


class Downsample2D(nn.Module):
    """Stride-2 3x3 conv. padding=1 (UNet) or 0 (VAE encoder: pad bottom/right by one)."""

    channels: int
    padding: int = 1
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, h, W, C) -> (B, h/2, W/2, C)
        return Conv(
            self.channels,
            stride=2,
            padding=self.padding,
            asym_pad=self.padding == 0,
            dtype=self.dtype,
            ops=self.ops,
            name="conv",
        )(x)


class Upsample2D(nn.Module):
    """Nearest 2x upsampling then a 3x3 conv (its halo is taken after upsampling: exact)."""

    channels: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, h, W, C) -> (B, 2h, 2W, C)
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return Conv(self.channels, dtype=self.dtype, ops=self.ops, name="conv")(x)


def timestep_embedding(
    t: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float = 10000.0
) -> jax.Array:
    """diffusers `get_timestep_embedding`: (B,) -> (B, dim), float32."""
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    args = t.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    emb = jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)
    if flip_sin_to_cos:
        emb = jnp.concatenate([emb[:, half:], emb[:, :half]], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class TimestepEmbedding(nn.Module):
    """linear_1 -> SiLU -> linear_2."""

    dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = dense(self.dim, "linear_1", self.dtype)(x.astype(self.dtype))
        return dense(self.dim, "linear_2", self.dtype)(nn.silu(x))


def as_list(value, n: int, what: str) -> list:
    """An int (or None) broadcast to n entries, or a sequence that must have n entries."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries, expected {n} (one per block)")
        return list(value)
    return [value] * n


class GeluFeedForward(nn.Module):
    """diffusers FeedForward with `gelu-approximate`: net.0.proj -> tanh GELU -> net.2, of
    `inner` hidden units (None: 4 x dim). Tensor parallel: net.0's outputs and net.2's inputs
    split over the model axis."""

    dim: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    inner: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        inner = (self.inner or 4 * self.dim) // self.ops.model_degree()
        h = _Proj(inner, self.dtype, name="net_0")(x)
        return dense(self.dim, "net_2", self.dtype, ops=self.ops)(nn.gelu(h, approximate=True))


class _Proj(nn.Module):  # diffusers' GELU module: a linear `proj`, then the activation
    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return dense(self.features, "proj", self.dtype)(x)


# ---------------------------------------------------------------- MMDiT (FLUX, SD3) parts


class RMSNorm(nn.Module):
    """torch.nn.RMSNorm over the last axis with a learned `scale` (diffusers' `weight`)."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last axis without affine parameters, float32 statistics."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class Modulation(nn.Module):
    """AdaLayerNormZero(Single/X)'s `linear` on SiLU(temb): (B, D) -> (B, parts, D), the parts
    in diffusers' chunk order."""

    parts: int
    dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, temb):
        m = dense(self.parts * self.dim, "linear", self.dtype)(nn.silu(temb))
        return m.reshape(m.shape[0], self.parts, self.dim)


class SiluProjection(nn.Module):
    """PixArtAlphaTextProjection with act_fn silu: linear_1, SiLU, linear_2."""

    dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = dense(self.dim, "linear_1", self.dtype)(x.astype(self.dtype))
        return dense(self.dim, "linear_2", self.dtype)(nn.silu(x))


class AdaNormContinuous(nn.Module):
    """AdaLayerNormContinuous (no affine): `linear` of SiLU(temb) -> scale, shift (in that
    order), applied to the LayerNorm of x (B, T, D)."""

    dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, temb):
        m = dense(2 * self.dim, "linear", self.dtype)(nn.silu(temb))
        scale, shift = m[:, None, : self.dim], m[:, None, self.dim :]
        return layer_norm(x) * (1 + scale) + shift


def apply_rope(x: jax.Array, rope: jax.Array) -> jax.Array:
    """x (B, T, H, D) rotated by rope (T, 2D) [cos | sin]: pairs (x_2k, x_2k+1) turn by their
    angle (diffusers' apply_rotary_emb, unbind dim -1), in float32."""
    d = x.shape[-1]
    cos, sin = rope[None, :, None, :d], rope[None, :, None, d:]
    xf = x.astype(jnp.float32)
    pairs = xf.reshape(*x.shape[:-1], d // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (xf * cos + rotated * sin).astype(x.dtype)


def rope_of_ids(ids: np.ndarray, dims, theta: float = 10000.0) -> np.ndarray:
    """(N, 2 x sum(dims)) float32 [cos | sin] of N tokens' integer ids (N, len(dims)): id axis i
    turns dims[i] of each head (float64 angles, each frequency's cos and sin repeated for its
    pair of dims), as diffusers' 1-D rotary embeddings with `repeat_interleave_real`."""
    cos, sin = [], []
    for i, d in enumerate(dims):
        freqs = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        angle = np.outer(ids[:, i].astype(np.float64), freqs)
        cos.append(np.repeat(np.cos(angle), 2, axis=1))
        sin.append(np.repeat(np.sin(angle), 2, axis=1))
    return np.concatenate([*cos, *sin], axis=1).astype(np.float32)
