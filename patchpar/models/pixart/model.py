"""Flax PixArt-α/Σ transformer (diffusers' `PixArtTransformer2DModel` layout, NHWC).

A latent (B, H, W, C) becomes H/p x W/p tokens by a p x p stride-p convolution, plus a fixed
2-D sin-cos position table; `num_layers` blocks of self-attention, cross-attention to the
projected caption and a GELU feed-forward, each modulated by adaLN-single: one projection of
the timestep embedding gives six vectors (shift, scale, gate for attention and feed-forward)
that every block adds to its own learned `scale_shift_table`. The output is un-patched to
(B, H, W, out_channels); `out_channels = 2 x in_channels` is learned sigma (the first half is
the noise prediction).

On a row slab only two things are global: the position table (each device needs its own rows
of the whole image's table: `ops.positions`) and self-attention's keys/values (the site
`ops.self_attention`, as in the UNet). LayerNorm, adaLN, cross-attention and the
feed-forward are per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models import scan
from patchpar.models.attention import AUTO, AttentionSpec
from patchpar.models.layers import (
    ATTENTION_AXES,
    Attention,
    GeluFeedForward,
    TimestepEmbedding,
    dense,
    timestep_embedding,
)
from patchpar.models.sites import IDENTITY, SiteOps

CLASS_NAMES = ("PixArtTransformer2DModel", "Transformer2DModel")
# Diffusion-transformer families whose folders patchpar recognises but cannot run yet.
UNSUPPORTED = {
    "QwenImageTransformer2DModel": "Qwen-Image (MMDiT)",
    "SanaTransformer2DModel": "Sana",
    "HunyuanDiT2DModel": "HunyuanDiT",
    "DiTTransformer2DModel": "DiT (class-conditional)",
}
# PixArt's logical axes (`parallel.rules`): its feed-forward is GELU, not gated, so net.0's
# output is `mlp`; everything else (adaLN, caption projection, patch embedding, proj_out, the
# modulation tables) reads or writes the model width whole.
LOGICAL: tuple[tuple[str, tuple], ...] = ATTENTION_AXES + (
    (r"ff/net_0/proj/kernel$", ("embed", "mlp")),
    (r"ff/net_0/proj/bias$", ("mlp",)),
    (r"ff/net_2/kernel$", ("mlp", "embed")),
)
BLOCKS = "transformer_blocks"
BLOCK = BLOCKS + "_{}"  # the blocks' parameter names, layer i
# config.json keys that must hold these values (anything else is another architecture)
_REQUIRED = {
    "norm_type": "ada_norm_single",
    "activation_fn": "gelu-approximate",
    "attention_type": "default",
    "norm_elementwise_affine": False,
    "only_cross_attention": False,
    "double_self_attention": False,
    "num_vector_embeds": None,
}


@dataclass(frozen=True)
class PixArtConfig:
    """The parts of a diffusers PixArt transformer config.json that shape the network."""

    num_attention_heads: int = 16
    attention_head_dim: int = 72
    in_channels: int = 4
    out_channels: int = 8
    num_layers: int = 28
    cross_attention_dim: int = 1152
    attention_bias: bool = True
    sample_size: int = 128
    patch_size: int = 2
    norm_eps: float = 1e-6
    interpolation_scale: float = 2.0
    use_additional_conditions: bool = True
    caption_channels: int | None = 4096
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def learned_sigma(self) -> bool:
        return self.out_channels == 2 * self.in_channels

    @classmethod
    def from_diffusers(cls, cfg: dict, where: str = "transformer/config.json") -> PixArtConfig:
        """Parse and validate; another architecture or an unsupported value raises ValueError."""
        name = cfg.get("_class_name", "PixArtTransformer2DModel")
        if name in UNSUPPORTED:
            raise ValueError(
                f"{where}: {UNSUPPORTED[name]} transformers ({name}) are not supported yet; "
                f"patchpar runs PixArt-α/Σ ({CLASS_NAMES[0]})"
            )
        if name not in CLASS_NAMES:
            raise ValueError(
                f"{where}: _class_name={name!r} is not a PixArt transformer (supported: "
                f"{list(CLASS_NAMES)})"
            )
        if cfg.get("patch_size") is None:
            raise ValueError(f"{where}: patch_size is missing: not a patched (DiT) transformer")
        for key, want in _REQUIRED.items():
            got = cfg.get(key, want)
            if got != want:
                raise ValueError(f"{where}: {key}={got!r} is not supported (PixArt has {want!r})")
        if cfg.get("num_embeds_ada_norm", 1000) is None:
            raise ValueError(f"{where}: num_embeds_ada_norm=None: adaLN-single needs it")
        heads = cfg.get("num_attention_heads", 16)
        head_dim = cfg.get("attention_head_dim", 72)
        inner = heads * head_dim
        cross = cfg.get("cross_attention_dim") or inner
        if cross != inner:
            raise ValueError(
                f"{where}: cross_attention_dim={cross} differs from the width {heads} x "
                f"{head_dim} = {inner}: PixArt projects the caption to the width first"
            )
        sample = cfg.get("sample_size", 128)
        extra_cond = cfg.get("use_additional_conditions")
        if extra_cond is None:  # diffusers: only the 1024-px PixArt-α has micro-conditions
            extra_cond = sample == 128
        if extra_cond and inner % 3:
            raise ValueError(
                f"{where}: micro-conditions split the width in thirds; {inner} is not "
                f"divisible by 3"
            )
        scale = cfg.get("interpolation_scale")
        in_ch = cfg.get("in_channels", 4)
        return cls(
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            in_channels=in_ch,
            out_channels=cfg.get("out_channels") or in_ch,
            num_layers=cfg.get("num_layers", 28),
            cross_attention_dim=cross,
            attention_bias=bool(cfg.get("attention_bias", True)),
            sample_size=sample,
            patch_size=cfg["patch_size"],
            norm_eps=cfg.get("norm_eps", 1e-6),
            interpolation_scale=float(scale if scale is not None else max(sample // 64, 1)),
            use_additional_conditions=bool(extra_cond),
            caption_channels=cfg.get("caption_channels"),
            extra=dict(cfg),
        )


def sincos_table(config: PixArtConfig, rows: int, cols: int) -> np.ndarray:
    """The (rows x cols, D) float32 position table of a rows x cols token grid, as diffusers
    computes it at any size: grid coordinates scaled to the training grid (`base_size` =
    sample_size / p) and by `interpolation_scale`, then per axis sin and cos of coordinate x
    frequency (float64). A constant: exact strategies stay bit-identical to one device."""
    dim = config.inner_dim
    if dim % 4:
        raise ValueError(f"2-D sin-cos positions need a width divisible by 4, got {dim}")
    base = config.sample_size // config.patch_size
    scale = np.float32(config.interpolation_scale)
    # float32 coordinates (as diffusers' torch code), then float64 frequencies
    y = np.arange(rows, dtype=np.float32) / np.float32(rows / base) / scale
    x = np.arange(cols, dtype=np.float32) / np.float32(cols / base) / scale
    xx, yy = np.meshgrid(x, y)  # (rows, cols): token (i, j) has x[j], y[i]

    def one_axis(pos):  # (N,) -> (N, D/2)
        omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4.0))
        out = np.outer(pos.reshape(-1).astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    # diffusers puts the x (width) coordinate's half first
    return np.concatenate([one_axis(xx), one_axis(yy)], axis=1).astype(np.float32)


def _layer_norm(eps: float, dtype, name: str | None = None, **kw) -> nn.LayerNorm:  # no affine
    return nn.LayerNorm(
        epsilon=eps,
        use_bias=False,
        use_scale=False,
        dtype=dtype,
        param_dtype=dtype,
        name=name,
        **kw,
    )


class PixArtBlock(nn.Module):
    """BasicTransformerBlock with adaLN-single (norm_type `ada_norm_single`)."""

    config: PixArtConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x, context, context_mask, t6, row=None, modulated_only: bool = False):
        # x (B, T, D), t6 (B, 6, D), row: tokens per image row (W / p); `modulated_only`: the
        # self-attention's modulated input alone (what TeaCache watches)
        cfg, dt = self.config, self.dtype
        d = cfg.inner_dim
        table = self.param("scale_shift_table", nn.initializers.normal(d**-0.5), (6, d), dt)
        mods = table[None] + t6  # (B, 6, D)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            mods[:, i : i + 1] for i in range(6)
        )

        def attention(name):
            return Attention(
                cfg.num_attention_heads,
                cfg.attention_head_dim,
                d,
                qkv_bias=cfg.attention_bias,
                dtype=dt,
                ops=self.ops,
                attn=self.attn,
                name=name,
            )

        h = _layer_norm(cfg.norm_eps, dt, "norm1")(x) * (1 + scale_msa) + shift_msa
        if modulated_only:
            return h
        x = gate_msa * attention("attn1")(h, row=row) + x  # the site: whole-image K/V
        # PixArt's cross-attention reads the residual stream without a norm
        x = attention("attn2")(x, context, context_mask) + x
        h = _layer_norm(cfg.norm_eps, dt, "norm2")(x) * (1 + scale_mlp) + shift_mlp
        return gate_mlp * GeluFeedForward(d, dt, self.ops, name="ff")(h) + x


class PatchEmbed(nn.Module):
    """p x p stride-p convolution `proj` (no halo: row slabs that are multiples of p hold whole
    patches), tokens row-major, plus this slab's rows of the whole image's position table."""

    config: PixArtConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, h, W, C) -> (B, h/p * W/p, D)
        cfg = self.config
        p = cfg.patch_size
        y = nn.Conv(
            cfg.inner_dim,
            (p, p),
            strides=(p, p),
            padding="VALID",
            dtype=self.dtype,
            param_dtype=self.dtype,
            name="proj",
        )(x.astype(self.dtype))
        b, rows, cols, d = y.shape
        pos = self.ops.positions(self, lambda r, c: sincos_table(cfg, r, c), rows, cols)
        return y.reshape(b, rows * cols, d) + pos[None].astype(self.dtype)


class AdaLayerNormSingle(nn.Module):
    """Timestep (and micro-condition) embedding `emb`, and its projection `linear` to the six
    modulation vectors: returns ((B, 6 D), embedded timestep (B, D))."""

    config: PixArtConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, timesteps, resolution=None, aspect_ratio=None):
        emb = _CombinedEmbedding(self.config, self.dtype, name="emb")(
            timesteps, resolution, aspect_ratio
        )
        return dense(6 * self.config.inner_dim, "linear", self.dtype)(nn.silu(emb)), emb


class _CombinedEmbedding(nn.Module):  # PixArtAlphaCombinedTimestepSizeEmbeddings
    config: PixArtConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, timesteps, resolution, aspect_ratio):
        cfg, dt = self.config, self.dtype
        d = cfg.inner_dim
        b = timesteps.shape[0]
        emb = TimestepEmbedding(d, dt, name="timestep_embedder")(
            timestep_embedding(timesteps, 256, True, 0.0)
        )
        if not cfg.use_additional_conditions:
            return emb
        if resolution is None or aspect_ratio is None:
            raise ValueError(
                "this PixArt transformer has micro-conditions (use_additional_conditions): "
                "pass resolution (B, 2) and aspect_ratio (B, 1)"
            )

        def size(name, v):  # (B, k) -> (B, k * D/3)
            e = timestep_embedding(jnp.asarray(v, jnp.float32).reshape(-1), 256, True, 0.0)
            return TimestepEmbedding(d // 3, dt, name=name)(e).reshape(b, -1)

        extra = [
            size("resolution_embedder", resolution),
            size("aspect_ratio_embedder", aspect_ratio),
        ]
        return emb + jnp.concatenate(extra, axis=-1)


class CaptionProjection(nn.Module):  # PixArtAlphaTextProjection: linear, tanh GELU, linear
    dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = dense(self.dim, "linear_1", self.dtype)(x.astype(self.dtype))
        return dense(self.dim, "linear_2", self.dtype)(nn.gelu(x, approximate=True))


# TeaCache's rescaling polynomial for PixArt, highest power first: patchpar's own fit, not a
# published one (TeaCache publishes none for PixArt): `experiments/teacache_fit.py` on the
# trained fmnist-dit's exact trajectories (20-step DPM-Solver++ 2M, guidance 2, the 10 class
# prompts x seeds 100-119: 380 step pairs, R^2 0.983); the record: results/teacache_fit/fit.json
TEACACHE_COEFFICIENTS = (
    260.83741735362713,
    -97.17831482558557,
    13.20978716359722,
    -0.6523486023143665,
    0.0177900443081044,
)


class PixArtTransformer2DModel(nn.Module):
    """diffusers PixArtTransformer2DModel. Runs unchanged on a row slab (rows a multiple of p);
    the sites go through `ops`. The forward is its parts in order: `context` (the projected
    caption), `time` (adaLN-single), `embed` (patches and positions), `block` i for every
    layer, `head` (the output layers); a strategy that splits the layers (PipeFusion) calls
    the same parts (`patchpar.models.pixart.Stack`)."""

    config: PixArtConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False  # the blocks as one scanned loop (`patchpar.models.scan`)

    teacache_coefficients = TEACACHE_COEFFICIENTS  # the `teacache` cache's rescaling

    def setup(self):
        cfg, dt, ops = self.config, self.dtype, self.ops
        layer = ops.layer  # every parameterised layer: FSDP gathers its weights there
        self.pos_embed = layer(PatchEmbed)(cfg, dt, ops)
        self.adaln_single = layer(AdaLayerNormSingle)(cfg, dt)
        if cfg.caption_channels is not None:
            self.caption_projection = layer(CaptionProjection)(cfg.inner_dim, dt)
        scan.build(self, BLOCKS, [0] * cfg.num_layers,
                   lambda i: (layer(PixArtBlock), (cfg, dt, ops, self.attn)))  # fmt: skip
        d = cfg.inner_dim
        self.scale_shift_table = self.param(
            "scale_shift_table", nn.initializers.normal(d**-0.5), (2, d), dt
        )
        self.proj_out = layer(nn.Dense)(
            cfg.patch_size**2 * cfg.out_channels, dtype=dt, param_dtype=dt
        )

    def __call__(
        self,
        sample: jax.Array,  # (B, h, W, Cin): the whole latent, or a row slab of it
        timesteps: jax.Array,  # (B,) or scalar
        encoder_hidden_states: jax.Array,  # (B, S, caption_channels): the T5 states
        encoder_attention_mask: jax.Array | None = None,  # (B, S): 1 = a real token
        resolution: jax.Array | None = None,  # (B, 2) image height, width (micro-condition)
        aspect_ratio: jax.Array | None = None,  # (B, 1) height / width (micro-condition)
    ) -> jax.Array:  # (B, h, W, Cout)
        hs, aux = self.prologue(sample, timesteps, encoder_hidden_states, encoder_attention_mask,
                                resolution, aspect_ratio)  # fmt: skip
        return self.epilogue(self.blocks(0, self.num_blocks, hs, aux), aux)

    # The forward as prologue, blocks [lo, hi), epilogue: what a step cache runs apart
    # (`patchpar.sampling.cache`). `hs` is what travels between blocks as a tuple whose first
    # element is the image tokens (here the only one); `aux` the rest the blocks read.

    @property
    def num_blocks(self) -> int:
        return self.config.num_layers

    def stack_params(self, params) -> dict:
        """Unrolled parameters in the scanned layout (`patchpar.models.scan.stack`)."""
        return scan.stack(params, BLOCKS, [0] * self.num_blocks)

    def prologue(self, sample, timesteps, encoder_hidden_states, encoder_attention_mask=None,
                 resolution=None, aspect_ratio=None):  # fmt: skip
        """-> ((tokens (B, T, D),), aux)."""
        b, h, w, _ = sample.shape
        timesteps = jnp.broadcast_to(jnp.asarray(timesteps), (b,))
        x = self.embed(sample)  # (B, T, D)
        temb = self.time(timesteps, resolution, aspect_ratio)
        ctx = self.context(encoder_hidden_states, encoder_attention_mask)
        return (x,), (temb, ctx, (h, w))

    def blocks(self, lo: int, hi: int, hs, aux):
        """Blocks lo..hi-1 on `hs`."""
        (x,), (temb, ctx, (_, w)) = hs, aux
        row = w // self.config.patch_size
        one = lambda i, c: (self.block(i, c[0], ctx, temb, row),)  # noqa: E731
        shared = (ctx[0], ctx[1], temb[0], row)
        return scan.run(self, BLOCKS, [0] * self.num_blocks, lo, hi, (x,), shared, one)

    def epilogue(self, hs, aux) -> jax.Array:
        temb, _, (h, w) = aux
        return self.head(hs[0], temb, h, w)

    def modulated(self, hs, aux) -> jax.Array:
        """The first block's modulated input to its self-attention (B, T, D): what TeaCache
        compares."""
        (x,), (temb, ctx, (_, w)) = hs, aux
        row = w // self.config.patch_size
        if "0" not in self.transformer_blocks:
            scan.refuse_apart(BLOCKS, 0)
        return self.transformer_blocks["0"](x, ctx[0], ctx[1], temb[0], row, modulated_only=True)

    def embed(self, sample: jax.Array) -> jax.Array:
        """(B, h, W, C) latent rows -> (B, h/p * W/p, D) tokens with their positions."""
        return self.pos_embed(sample)

    def time(self, timesteps, resolution=None, aspect_ratio=None) -> tuple[jax.Array, jax.Array]:
        """((B, 6, D) block modulations, (B, D) embedded timestep)."""
        t6, emb = self.adaln_single(timesteps, resolution, aspect_ratio)
        return t6.reshape(timesteps.shape[0], 6, self.config.inner_dim), emb

    def context(self, encoder_hidden_states, encoder_attention_mask=None):
        """(projected caption (B, S, D), its key mask (B, S) bool or None): step-invariant."""
        ctx = encoder_hidden_states.astype(self.dtype)
        if self.config.caption_channels is not None:
            ctx = self.caption_projection(ctx)
        keep = None if encoder_attention_mask is None else encoder_attention_mask.astype(bool)
        return ctx, keep

    def block(self, i: int, x, ctx, temb, row: int) -> jax.Array:
        """Block i on (B, T, D) tokens; `row`: tokens per image row (W / p)."""
        if str(i) not in self.transformer_blocks:
            scan.refuse_apart(BLOCKS, i)
        return self.transformer_blocks[str(i)](x, ctx[0], ctx[1], temb[0], row)

    def head(self, x, temb, h: int, w: int) -> jax.Array:
        """(B, T, D) tokens of an h x w latent slab -> (B, h, w, out_channels)."""
        return output_head(self.config, self.dtype, x, temb[1], self.scale_shift_table,
                           self.proj_out, h, w)  # fmt: skip


def output_head(config: PixArtConfig, dtype, x, emb, table, proj, h: int, w: int) -> jax.Array:
    """The model's last layers on (B, T, D) tokens of an h x w latent slab: norm_out modulated
    by `table` (2, D) + the embedded timestep, `proj` (proj_out) and un-patching to
    (B, h, w, out_channels)."""
    p, b = config.patch_size, x.shape[0]
    mods = table[None] + emb[:, None]  # (B, 2, D)
    shift, scale = mods[:, :1], mods[:, 1:]
    x = _layer_norm(1e-6, dtype, parent=None).apply({}, x) * (1 + scale) + shift
    x = proj(x).reshape(b, h // p, w // p, p, p, config.out_channels)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, config.out_channels)
