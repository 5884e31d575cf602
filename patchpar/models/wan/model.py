"""Flax Wan 2.1 / 2.2 transformer (diffusers' `WanTransformer3DModel`), on a video latent laid
out as a tall image.

A video latent (B, F, H, W, C) reaches the model as one (B, R, W, C) array of R = F x H rows,
in the order a `Video` layout gives: `frames` (frame after frame, as diffusers flattens its
tokens), `rows` (token row after token row, each with every frame's), or `FxR` blocks (a grid of
frame blocks x row blocks, block after block). Every layout keeps each token's p_h latent rows
together, so the 1 x p x p patch embedding (a Conv3d whose temporal patch is 1) is a p x p
stride-p convolution of the tall image, and un-patching its inverse: the model is the same
program for every layout, and a row slab of the tall image is whatever block of the video the
layout puts there. Only the positions know the layout: the 3-D RoPE of each token (its frame,
row and column), which `ops.positions` slices per device like any DiT's position table.

Each of `num_layers` blocks: self-attention with RMSNorm over all heads on Q and K and RoPE
(the site `ops.self_attention`: the whole video's keys/values), cross-attention to the
projected umT5 text (local; LayerNorm with affine first, `cross_attn_norm`), a tanh-GELU
feed-forward of `ffn_dim`; the timestep's projection to six vectors modulates it (each block
adds its own `scale_shift_table`), in float32 as diffusers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models import scan
from patchpar.models.attention import AUTO, AttentionSpec, attend
from patchpar.models.layers import (
    GeluFeedForward,
    TimestepEmbedding,
    apply_rope,
    dense,
    layer_norm,
    rope_of_ids,
    timestep_embedding,
)
from patchpar.models.sites import IDENTITY, SiteOps
from patchpar.models.wan.layout import LAYOUTS, Video, grid  # noqa: F401  (re-exported)

CLASS_NAMES = ("WanTransformer3DModel",)
BLOCKS = (
    "transformer_blocks"  # diffusers' `blocks.<i>` (a method here is `blocks`): renamed on load
)
# Wan's logical axes (`parallel.rules`): heads split under tensor parallelism, with Q's and K's
# RMSNorm scales (the norm runs over every head: its mean square is summed over the model axis)
LOGICAL: tuple[tuple[str, tuple], ...] = (
    (r"attn[12]/to_[qkv]/kernel$", ("embed", "heads")),
    (r"attn[12]/to_[qkv]/bias$", ("heads",)),
    (r"attn[12]/norm_[qk]/scale$", ("heads",)),
    (r"attn[12]/to_out_0/kernel$", ("heads", "embed")),
    (r"ffn/net_0/proj/kernel$", ("embed", "mlp")),
    (r"ffn/net_0/proj/bias$", ("mlp",)),
    (r"ffn/net_2/kernel$", ("mlp", "embed")),
)


@dataclass(frozen=True)
class WanConfig:
    """The parts of a diffusers Wan transformer config.json that shape the network."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def spatial_patch(self) -> int:
        return self.patch_size[1]

    @classmethod
    def from_diffusers(cls, cfg: dict, where: str = "transformer/config.json") -> WanConfig:
        """Parse and validate; another architecture or an unsupported value raises ValueError."""
        name = cfg.get("_class_name", CLASS_NAMES[0])
        if name not in CLASS_NAMES:
            raise ValueError(
                f"{where}: _class_name={name!r} is not a Wan transformer (supported: "
                f"{list(CLASS_NAMES)})"
            )
        raw = cfg.get("patch_size", (1, 2, 2))
        patch = tuple(raw) if isinstance(raw, list | tuple) else (raw,)
        if len(patch) != 3 or patch[0] != 1 or patch[1] != patch[2]:
            raise ValueError(
                f"{where}: patch_size={raw!r} is not supported: patchpar runs Wan's (1, p, p) "
                f"patches (one frame deep, square)"
            )
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if cfg.get(key) is not None:
                raise ValueError(
                    f"{where}: {key}={cfg[key]!r} is an image-to-video transformer (image "
                    f"conditioning); patchpar runs Wan's text-to-video transformers"
                )
        qk = cfg.get("qk_norm", "rms_norm_across_heads")
        if qk != "rms_norm_across_heads":
            raise ValueError(
                f"{where}: qk_norm={qk!r} is not supported (Wan has 'rms_norm_across_heads')"
            )
        heads, head_dim = cfg.get("num_attention_heads", 40), cfg.get("attention_head_dim", 128)
        if head_dim % 2 or head_dim < 6:
            raise ValueError(
                f"{where}: attention_head_dim={head_dim}: the 3-D RoPE splits each head in "
                f"three even parts (t, h, w); use an even head size of at least 6"
            )
        in_ch = cfg.get("in_channels", 16)
        return cls(
            patch_size=patch,
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            in_channels=in_ch,
            out_channels=cfg.get("out_channels") or in_ch,
            text_dim=cfg.get("text_dim", 4096),
            freq_dim=cfg.get("freq_dim", 256),
            ffn_dim=cfg.get("ffn_dim", 13824),
            num_layers=cfg.get("num_layers", 40),
            cross_attn_norm=bool(cfg.get("cross_attn_norm", True)),
            eps=cfg.get("eps", 1e-6),
            rope_max_seq_len=cfg.get("rope_max_seq_len", 1024),
            extra=dict(cfg),
        )


def rope_table(config: WanConfig, video: Video, rows: int, cols: int) -> np.ndarray:
    """(rows x cols, 2 x head_dim) float32 [cos | sin] of the tall image's token grid (`rows`
    token rows): each token's (frame, row, column) rotates the head's t, h, w parts
    (h = w = 2 (head_dim // 6), t the rest), as diffusers' WanRotaryPosEmbed (float64 angles,
    each frequency's cos and sin repeated for its pair of dims)."""
    d = config.attention_head_dim
    hw = 2 * (d // 6)
    dims = (d - 2 * hw, hw, hw)
    order = video.units(rows * config.spatial_patch, config.spatial_patch)  # (rows, 2)
    ids = np.stack([np.repeat(order[:, 0], cols), np.repeat(order[:, 1], cols),
                    np.tile(np.arange(cols), rows)], axis=1)  # fmt: skip
    return rope_of_ids(ids, dims)


class HeadsRMSNorm(nn.Module):
    """torch.nn.RMSNorm over every head's dims (`rms_norm_across_heads`); under tensor
    parallelism this device holds `share` of them: the mean square is summed over the model
    axis (zero heads that pad a count add nothing)."""

    total: int  # the width it normalises over (all heads)
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        sq = jnp.sum(xf * xf, axis=-1, keepdims=True)
        if self.ops.model_degree() > 1:
            sq = self.ops.model_sum(self, sq)
        y = xf * jax.lax.rsqrt(sq / self.total + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


class WanAttention(nn.Module):
    """diffusers WanAttention: to_q/to_k/to_v/to_out.0 with biases, RMSNorm over all heads on
    Q and K. Self-attention (no context) rotates Q and K by `rope` and goes through the site."""

    config: WanConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x, context=None, rope=None, row: int | None = None) -> jax.Array:
        cfg, dt, ops = self.config, self.dtype, self.ops
        heads = -(-cfg.num_attention_heads // ops.model_degree())  # this device's (padded)
        d = cfg.attention_head_dim
        inner = heads * d
        src = x if context is None else context
        q = dense(inner, "to_q", dt)(x)
        k = dense(inner, "to_k", dt)(src)
        v = dense(inner, "to_v", dt)(src)
        q = HeadsRMSNorm(cfg.inner_dim, cfg.eps, dt, ops, name="norm_q")(q)
        k = HeadsRMSNorm(cfg.inner_dim, cfg.eps, dt, ops, name="norm_k")(k)
        if context is None:
            split = lambda a: a.reshape(*a.shape[:-1], heads, d)  # noqa: E731
            q = apply_rope(split(q), rope).reshape(q.shape)
            k = apply_rope(split(k), rope).reshape(k.shape)
            out = ops.self_attention(self, q, k, v, heads, self.attn, row)
        else:  # the text: local on every device
            out = attend(self.attn, q, k, v, heads, None)
        return dense(cfg.inner_dim, "to_out_0", dt, ops=ops)(out)


class WanBlock(nn.Module):
    """diffusers WanTransformerBlock."""

    config: WanConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x, context, t6, rope, row=None, modulated_only: bool = False):
        # x (B, T, D), context (B, S, D), t6 (B, 6, D) float32, rope (T, 2 head_dim)
        cfg, dt = self.config, self.dtype
        d = cfg.inner_dim
        table = self.param("scale_shift_table", nn.initializers.normal(d**-0.5), (1, 6, d), dt)
        mods = table.astype(jnp.float32) + t6.astype(jnp.float32)  # (B, 6, D)
        shift, scale, gate, c_shift, c_scale, c_gate = (mods[:, i : i + 1] for i in range(6))
        attention = lambda name: WanAttention(cfg, dt, self.ops, self.attn, name=name)  # noqa: E731
        h = (layer_norm(x, cfg.eps) * (1 + scale) + shift).astype(dt)
        if modulated_only:
            return h
        a = attention("attn1")(h, rope=rope, row=row)
        x = (x.astype(jnp.float32) + a * gate).astype(dt)
        if cfg.cross_attn_norm:
            n = nn.LayerNorm(cfg.eps, dtype=jnp.float32, param_dtype=dt, name="norm2")
            h = n(x.astype(jnp.float32)).astype(dt)
        else:
            h = x
        x = x + attention("attn2")(h, context)
        h = (layer_norm(x, cfg.eps) * (1 + c_scale) + c_shift).astype(dt)
        ff = GeluFeedForward(d, dt, self.ops, inner=cfg.ffn_dim, name="ffn")(h)
        return (x.astype(jnp.float32) + ff.astype(jnp.float32) * c_gate).astype(dt)


class ConditionEmbedder(nn.Module):
    """diffusers WanTimeTextImageEmbedding (text-to-video): the timestep's sinusoid through
    `time_embedder` (temb), its SiLU through `time_proj` (the six block modulations), and the
    text through `text_embedder` (linear, tanh GELU, linear). Each of the three is a layer of
    its own for FSDP (`ops.layer`): a call gathers the weights it uses, not the others'."""

    config: WanConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    def setup(self):
        d, dt, layer = self.config.inner_dim, self.dtype, self.ops.layer
        self.time_embedder = layer(TimestepEmbedding)(d, dt)
        self.time_proj = layer(nn.Dense)(6 * d, dtype=dt, param_dtype=dt)
        self.text_embedder = layer(TextProjection)(d, dt)

    def time(self, timesteps: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(B,) -> ((B, 6, D) modulations, (B, D) temb)."""
        e = timestep_embedding(timesteps, self.config.freq_dim, True, 0.0)
        temb = self.time_embedder(e.astype(self.dtype))
        t6 = self.time_proj(nn.silu(temb))
        return t6.reshape(temb.shape[0], 6, -1), temb

    def text(self, states: jax.Array) -> jax.Array:
        return self.text_embedder(states.astype(self.dtype))


class TextProjection(nn.Module):  # PixArtAlphaTextProjection with tanh GELU
    dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = dense(self.dim, "linear_1", self.dtype)(x)
        return dense(self.dim, "linear_2", self.dtype)(nn.gelu(x, approximate=True))


class WanTransformer3DModel(nn.Module):
    """diffusers WanTransformer3DModel on the tall image of `video` (module docstring). The
    forward is its parts in order: `context` (the projected text), `time`, `embed` (patches and
    their RoPE), `block` i, `head`; a strategy that splits the layers calls the same parts."""

    config: WanConfig
    video: Video = Video()
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False  # the blocks as one scanned loop (`patchpar.models.scan`)

    def setup(self):
        cfg, dt, ops = self.config, self.dtype, self.ops
        layer = ops.layer  # every parameterised layer: FSDP gathers its weights there
        p = cfg.spatial_patch
        self.patch_embedding = layer(PatchEmbed3D)(cfg.inner_dim, p, dt, name="patch_embedding")
        self.rope = WanRope(cfg, self.video, ops)
        self.condition_embedder = ConditionEmbedder(cfg, dt, ops)  # its layers: FSDP's each
        scan.build(self, BLOCKS, [0] * cfg.num_layers,
                   lambda i: (layer(WanBlock), (cfg, dt, ops, self.attn)))  # fmt: skip
        d = cfg.inner_dim
        self.scale_shift_table = self.param(
            "scale_shift_table", nn.initializers.normal(d**-0.5), (1, 2, d), dt
        )
        self.proj_out = layer(nn.Dense)(p * p * cfg.out_channels, dtype=dt, param_dtype=dt)

    def __call__(
        self,
        sample: jax.Array,  # (B, h, W, Cin): rows of the tall image (the whole, or a slab)
        timesteps: jax.Array,  # (B,) or scalar
        encoder_hidden_states: jax.Array,  # (B, S, text_dim): the umT5 states
    ) -> jax.Array:  # (B, h, W, Cout)
        hs, aux = self.prologue(sample, timesteps, encoder_hidden_states)
        return self.epilogue(self.blocks(0, self.num_blocks, hs, aux), aux)

    @property
    def num_blocks(self) -> int:
        return self.config.num_layers

    def stack_params(self, params) -> dict:
        """Unrolled parameters in the scanned layout (`patchpar.models.scan.stack`)."""
        return scan.stack(params, BLOCKS, [0] * self.num_blocks)

    def prologue(self, sample, timesteps, encoder_hidden_states):
        """-> ((tokens (B, T, D),), aux)."""
        b, h, w, _ = sample.shape
        timesteps = jnp.broadcast_to(jnp.asarray(timesteps), (b,))
        x, rope = self.embed(sample)
        t6, temb = self.time(timesteps)
        ctx = self.context(encoder_hidden_states)
        return (x,), ((t6, temb), ctx, rope, (h, w))

    def blocks(self, lo: int, hi: int, hs, aux):
        """Blocks lo..hi-1 on `hs`."""
        (x,), ((t6, _), ctx, rope, (_, w)) = hs, aux
        row = w // self.config.spatial_patch
        one = lambda i, c: (self.block(i, c[0], ctx, t6, rope, row),)  # noqa: E731
        shared = (ctx, t6, rope, row)
        return scan.run(self, BLOCKS, [0] * self.num_blocks, lo, hi, (x,), shared, one)

    def epilogue(self, hs, aux) -> jax.Array:
        (_, temb), _, _, (h, w) = aux
        return self.head(hs[0], temb, h, w)

    def modulated(self, hs, aux) -> jax.Array:
        """The first block's modulated input to its self-attention (B, T, D): what TeaCache
        compares."""
        (x,), ((t6, _), ctx, rope, (_, w)) = hs, aux
        if "0" not in self.transformer_blocks:
            scan.refuse_apart(BLOCKS, 0)
        row = w // self.config.spatial_patch
        return self.transformer_blocks["0"](x, ctx, t6, rope, row, modulated_only=True)

    def embed(self, sample: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(B, h, W, C) rows of the tall image -> ((B, h/p * W/p, D) tokens, their RoPE)."""
        x = self.patch_embedding(sample.astype(self.dtype))
        b, rows, cols, d = x.shape
        return x.reshape(b, rows * cols, d), self.rope(rows, cols)

    def time(self, timesteps) -> tuple[jax.Array, jax.Array]:
        """((B, 6, D) block modulations, (B, D) temb)."""
        return self.condition_embedder.time(timesteps)

    def context(self, encoder_hidden_states) -> jax.Array:
        """The projected text (B, S, D): step-invariant."""
        return self.condition_embedder.text(encoder_hidden_states)

    def block(self, i: int, x, ctx, t6, rope, row: int) -> jax.Array:
        """Block i on (B, T, D) tokens; `row`: tokens per row of the tall image (W / p)."""
        if str(i) not in self.transformer_blocks:
            scan.refuse_apart(BLOCKS, i)
        return self.transformer_blocks[str(i)](x, ctx, t6, rope, row)

    def head(self, x, temb, h: int, w: int) -> jax.Array:
        """(B, T, D) tokens of an h x w slab of the tall image -> (B, h, w, out_channels)."""
        cfg = self.config
        p, b = cfg.spatial_patch, x.shape[0]
        mods = self.scale_shift_table.astype(jnp.float32) + temb.astype(jnp.float32)[:, None]
        shift, scale = mods[:, :1], mods[:, 1:]
        x = (layer_norm(x, cfg.eps) * (1 + scale) + shift).astype(self.dtype)
        x = self.proj_out(x).reshape(b, h // p, w // p, p, p, cfg.out_channels)
        return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, cfg.out_channels)


class WanRope(nn.Module):
    """This slab's rows of the tall image's RoPE table (`rope_table`), through the position
    site (`ops.positions`: a constant sliced per device or per pipelined patch); no
    parameters."""

    config: WanConfig
    video: Video
    ops: SiteOps = IDENTITY

    def __call__(self, rows: int, cols: int) -> jax.Array:
        cfg, video = self.config, self.video
        return self.ops.positions(self, lambda r, c: rope_table(cfg, video, r, c), rows, cols)


class PatchEmbed3D(nn.Module):
    """diffusers' Conv3d `patch_embedding` with a (1, p, p) kernel and stride: on the tall
    image, a p x p stride-p convolution; its kernel kept 5-D (1, p, p, C, D) as the
    checkpoint's."""

    features: int
    patch: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, h, W, C) -> (B, h/p, W/p, D)
        p, c = self.patch, x.shape[-1]
        init = nn.initializers.lecun_normal()
        kernel = self.param("kernel", init, (1, p, p, c, self.features), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        y = jax.lax.conv_general_dilated(
            x, kernel[0], (p, p), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return y + bias
