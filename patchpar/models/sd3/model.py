"""Flax SD3 / SD3.5 transformer (diffusers' `SD3Transformer2DModel` layout), called on the NHWC
latent.

The latent (B, H, W, 16) is cut into p x p patches by a stride-p convolution (`pos_embed.proj`)
and each token gets its row of a 2-D sin-cos table (`pos_embed_max_size`^2 positions, the image's
centre crop of it); the text states (CLIP-L and CLIP-G penultimate states side by side, zero-
padded to T5's width, then T5's states) are projected (`context_embedder`); the timestep and the
pooled CLIP embeddings make one conditioning vector `temb`. Then `num_layers` joint blocks
(MMDiT): image and text each with adaLN-Zero, their own Q/K/V (RMSNorm on Q and K with
`qk_norm`), one attention over [image; text], and each its own feed-forward. The last block is
`context_pre_only`: its text tokens only give keys and values. The blocks of
`dual_attention_layers` (SD3.5-medium) add a second attention over the image tokens alone
(`attn2`, modulated by the 3 extra parts of SD35AdaLayerNormZeroX). The output is
AdaLayerNormContinuous, `proj_out` and unpatchifying.

On a row slab (rows a multiple of p: whole tokens) only two things are global: the positions
(a constant table; each device takes its rows) and the image keys/values of each attention
(the site `ops.joint_attention`, and `ops.self_attention` for `attn2`). Text tokens stay local:
every device computes the whole text stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models import scan
from patchpar.models.attention import AUTO, AttentionSpec
from patchpar.models.layers import (
    AdaNormContinuous,
    GeluFeedForward,
    Modulation,
    RMSNorm,
    SiluProjection,
    TimestepEmbedding,
    dense,
    layer_norm,
    timestep_embedding,
)
from patchpar.models.sites import IDENTITY, SiteOps

CLASS_NAMES = ("SD3Transformer2DModel",)
BLOCKS = "transformer_blocks"
BLOCK = BLOCKS + "_{}"  # the joint blocks' parameter names, layer i
# SD3's logical axes (`parallel.rules`): heads in every attention projection (both attentions
# of a dual block), the feed-forwards' widths.
LOGICAL: tuple[tuple[str, tuple], ...] = (
    (r"attn2?/(to_[qkv]|add_[qkv]_proj)/kernel$", ("embed", "heads")),
    (r"attn2?/(to_[qkv]|add_[qkv]_proj)/bias$", ("heads",)),
    (r"attn2?/(to_out_0|to_add_out)/kernel$", ("heads", "embed")),
    (r"ff(_context)?/net_0/proj/kernel$", ("embed", "mlp")),
    (r"ff(_context)?/net_0/proj/bias$", ("mlp",)),
    (r"ff(_context)?/net_2/kernel$", ("mlp", "embed")),
)
QK_NORMS = (None, "rms_norm")


@dataclass(frozen=True)
class SD3Config:
    """The parts of a diffusers SD3Transformer2DModel config.json that shape the network."""

    sample_size: int = 128  # latent pixels of the training image (the positions' base size)
    patch_size: int = 2
    in_channels: int = 16
    out_channels: int = 16
    num_layers: int = 24
    attention_head_dim: int = 64
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1536
    pooled_projection_dim: int = 2048
    pos_embed_max_size: int = 192
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def latent_channels(self) -> int:
        return self.in_channels

    @classmethod
    def from_diffusers(cls, cfg: dict, where: str = "transformer/config.json") -> SD3Config:
        """Parse and validate; another architecture or an unsupported value raises ValueError."""
        name = cfg.get("_class_name", CLASS_NAMES[0])
        if name not in CLASS_NAMES:
            raise ValueError(f"{where}: _class_name={name!r} is not {CLASS_NAMES[0]}")
        heads, head = cfg.get("num_attention_heads", 18), cfg.get("attention_head_dim", 64)
        layers = cfg.get("num_layers", 18)
        caption = cfg.get("caption_projection_dim", 1152)
        if caption != heads * head:
            raise ValueError(
                f"{where}: caption_projection_dim={caption} must equal the width "
                f"num_attention_heads x attention_head_dim = {heads * head} (the text stream "
                f"joins the image's in every block)"
            )
        dual = tuple(int(i) for i in cfg.get("dual_attention_layers") or ())
        bad = [i for i in dual if not 0 <= i < layers]
        if bad:
            raise ValueError(
                f"{where}: dual_attention_layers has index(es) {bad} outside the model's "
                f"{layers} layers (0..{layers - 1})"
            )
        if cfg.get("qk_norm") not in QK_NORMS:
            raise ValueError(
                f"{where}: qk_norm={cfg['qk_norm']!r} is not supported (supported: {list(QK_NORMS)})"
            )
        if (heads * head) % 4:
            raise ValueError(f"{where}: 2-D sin-cos positions need a width divisible by 4")
        in_ch = cfg.get("in_channels", 16)
        return cls(
            sample_size=cfg.get("sample_size", 128),
            patch_size=cfg.get("patch_size", 2),
            in_channels=in_ch,
            out_channels=cfg.get("out_channels") or in_ch,
            num_layers=layers,
            attention_head_dim=head,
            num_attention_heads=heads,
            joint_attention_dim=cfg.get("joint_attention_dim", 4096),
            caption_projection_dim=caption,
            pooled_projection_dim=cfg.get("pooled_projection_dim", 2048),
            pos_embed_max_size=cfg.get("pos_embed_max_size", 96),
            dual_attention_layers=dual,
            qk_norm=cfg.get("qk_norm"),
            extra=dict(cfg),
        )


def sincos_grid(
    dim: int, grid: int, base: int, window: tuple[int, int, int, int] | None = None
) -> np.ndarray:
    """(grid, grid, dim) float32: diffusers' get_2d_sincos_pos_embed of a grid x grid table at
    base size `base` (interpolation scale 1): coordinates scaled to the base grid in float32,
    frequencies in float64, the x (width) coordinate's half first. `window` = (top, left,
    rows, cols): only that (rows, cols, dim) part of it, the same values (each entry depends
    on its own coordinates only) without the whole table (SD3.5-large's is 192 x 192 x 2432)."""
    pos = np.arange(grid, dtype=np.float32) / np.float32(grid / base)
    top, left, rows, cols = (0, 0, grid, grid) if window is None else window
    xx, yy = np.meshgrid(pos[left : left + cols], pos[top : top + rows])  # x = col, y = row

    def one_axis(p):  # (N,) -> (N, dim / 2)
        omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4.0))
        out = np.outer(p.reshape(-1).astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    table = np.concatenate([one_axis(xx), one_axis(yy)], axis=1).astype(np.float32)
    return table.reshape(rows, cols, dim)


def position_table(config: SD3Config, rows: int, cols: int) -> np.ndarray:
    """(rows x cols, D) float32: the centre crop of the pos_embed_max_size^2 table that
    diffusers' PatchEmbed gives a rows x cols token grid (`cropped_pos_embed`). A constant:
    exact strategies stay bit-identical to one device."""
    m = config.pos_embed_max_size
    if rows > m or cols > m:
        raise ValueError(
            f"a {rows} x {cols} token grid is larger than the model's positions "
            f"(pos_embed_max_size={m} tokens a side, {m * config.patch_size} latent pixels)"
        )
    base = config.sample_size // config.patch_size
    return _crop(config.inner_dim, m, base, (m - rows) // 2, (m - cols) // 2, rows, cols)


@lru_cache(maxsize=8)
def _crop(dim: int, m: int, base: int, top: int, left: int, rows: int, cols: int) -> np.ndarray:
    """The crop, computed once per shape: a program traces the embedding several times
    (shapes, warm-up, steady)."""
    table = sincos_grid(dim, m, base, (top, left, rows, cols)).reshape(rows * cols, dim)
    table.flags.writeable = False
    return table


class JointAttention(nn.Module):
    """diffusers Attention with JointAttnProcessor2_0: Q/K/V of the image tokens (to_q/k/v)
    and of the text tokens (add_q/k/v_proj), RMSNorm per head on Q and K (`qk_norm`), one
    attention over image and text keys through the site `ops.joint_attention`; outputs through
    to_out.0 (image) and to_add_out (text; none in a `context_pre_only` block)."""

    heads: int
    dim_head: int
    dim: int
    qk_norm: str | None
    pre_only: bool = False
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, img, txt, row: int):
        heads = -(-self.heads // self.ops.model_degree())  # tensor parallel: padded heads
        inner, dt, hd = heads * self.dim_head, self.dtype, self.dim_head

        def project(x, names, norms):
            q, k, v = (dense(inner, n, dt)(x) for n in names)
            if self.qk_norm is None:
                return q, k, v
            split = lambda a: a.reshape(*a.shape[:-1], heads, hd)  # noqa: E731
            q = RMSNorm(1e-6, dt, name=norms[0])(split(q)).reshape(q.shape)
            k = RMSNorm(1e-6, dt, name=norms[1])(split(k)).reshape(k.shape)
            return q, k, v

        qi, ki, vi = project(img, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
        qt, kt, vt = project(
            txt, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k")
        )
        s = txt.shape[1]
        q = jnp.concatenate([qt, qi], axis=1)  # the site takes [text; image] queries
        out = self.ops.joint_attention(self, q, kt, vt, ki, vi, heads, self.attn, row)
        img_out = dense(self.dim, "to_out_0", dt, ops=self.ops)(out[:, s:])
        if self.pre_only:
            return img_out, None
        return img_out, dense(self.dim, "to_add_out", dt, ops=self.ops)(out[:, :s])


class SelfAttention(nn.Module):
    """A dual block's `attn2`: self-attention over the image tokens (to_q/k/v, to_out.0, RMSNorm
    on Q and K with `qk_norm`) through the site `ops.self_attention`."""

    heads: int
    dim_head: int
    dim: int
    qk_norm: str | None
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x, row: int):
        heads = -(-self.heads // self.ops.model_degree())
        inner, dt, hd = heads * self.dim_head, self.dtype, self.dim_head
        q, k, v = (dense(inner, n, dt)(x) for n in ("to_q", "to_k", "to_v"))
        if self.qk_norm is not None:
            split = lambda a: a.reshape(*a.shape[:-1], heads, hd)  # noqa: E731
            q = RMSNorm(1e-6, dt, name="norm_q")(split(q)).reshape(q.shape)
            k = RMSNorm(1e-6, dt, name="norm_k")(split(k)).reshape(k.shape)
        out = self.ops.self_attention(self, q, k, v, heads, self.attn, row)
        return dense(self.dim, "to_out_0", dt, ops=self.ops)(out)


class JointBlock(nn.Module):
    """JointTransformerBlock: adaLN-Zero on image (norm1; SD35AdaLayerNormZeroX's 9 parts in a
    dual block) and text (norm1_context; AdaLayerNormContinuous when `pre_only`), the joint
    attention, a dual block's image self-attention, then each stream's feed-forward (the text's
    none when `pre_only`: its tokens end there)."""

    config: SD3Config
    pre_only: bool = False
    dual: bool = False
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, img, txt, temb, row: int):
        cfg, dt, d = self.config, self.dtype, self.config.inner_dim
        heads, hd, ops = cfg.num_attention_heads, cfg.attention_head_dim, self.ops
        mi = Modulation(9 if self.dual else 6, d, dt, name="norm1")(temb)[:, :, None]
        normed = layer_norm(img)
        hi = normed * (1 + mi[:, 1]) + mi[:, 0]
        if self.pre_only:
            ht = AdaNormContinuous(d, dt, name="norm1_context")(txt, temb)
        else:
            mt = Modulation(6, d, dt, name="norm1_context")(temb)[:, :, None]
            ht = layer_norm(txt) * (1 + mt[:, 1]) + mt[:, 0]
        ai, at = JointAttention(heads, hd, d, cfg.qk_norm, self.pre_only, dt, ops, self.attn,
                                name="attn")(hi, ht, row)  # fmt: skip
        img = img + mi[:, 2] * ai
        if self.dual:  # attn2 reads the block's input, modulated by the 3 extra parts
            h2 = normed * (1 + mi[:, 7]) + mi[:, 6]
            a2 = SelfAttention(heads, hd, d, cfg.qk_norm, dt, ops, self.attn, name="attn2")(h2, row)
            img = img + mi[:, 8] * a2
        h = layer_norm(img) * (1 + mi[:, 4]) + mi[:, 3]
        img = img + mi[:, 5] * GeluFeedForward(d, dt, ops, name="ff")(h)
        if self.pre_only:
            return img, None
        txt = txt + mt[:, 2] * at
        h = layer_norm(txt) * (1 + mt[:, 4]) + mt[:, 3]
        txt = txt + mt[:, 5] * GeluFeedForward(d, dt, ops, name="ff_context")(h)
        return img, txt


class PatchEmbed(nn.Module):
    """p x p stride-p convolution `proj` (no halo: a row slab of whole patches), tokens
    row-major, plus this slab's rows of the whole image's cropped position table."""

    config: SD3Config
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:  # (B, h, W, C) -> (B, h/p * W/p, D)
        cfg, p = self.config, self.config.patch_size
        y = nn.Conv(cfg.inner_dim, (p, p), strides=(p, p), padding="VALID", dtype=self.dtype,
                    param_dtype=self.dtype, name="proj")(x.astype(self.dtype))  # fmt: skip
        b, rows, cols, d = y.shape
        pos = self.ops.positions(self, lambda r, c: position_table(cfg, r, c), rows, cols)
        return y.reshape(b, rows * cols, d) + pos[None].astype(self.dtype)


class _TimeText(nn.Module):  # CombinedTimestepTextProjEmbeddings' parameter layout
    config: SD3Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, timesteps, pooled):
        d = self.config.inner_dim
        # the pipeline passes sigma x 1000; diffusers embeds it in float32
        emb = TimestepEmbedding(d, self.dtype, name="timestep_embedder")(
            timestep_embedding(timesteps.astype(jnp.float32), 256, True, 0.0)
        )
        return emb + SiluProjection(d, self.dtype, name="text_embedder")(pooled)


def _text_read(ops: SiteOps, block, out):
    """A scanned block's output as the next block reads it: its text tokens through the
    text-stream site (`SD3Transformer2DModel.block`; the last block, which leaves none, is
    never scanned)."""
    img, txt = out
    return img, ops.text_stream(block, txt)


class SD3Transformer2DModel(nn.Module):
    """diffusers SD3Transformer2DModel on the NHWC latent. Runs unchanged on a row slab (rows a
    multiple of p); the sites go through `ops`. The forward is its parts in order: `embed`,
    `time`, `context`, `block` i, `head`."""

    config: SD3Config
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False  # each run of identical blocks as one scanned loop (`models.scan`)

    def setup(self):
        cfg, dt, ops = self.config, self.dtype, self.ops
        layer = ops.layer  # every parameterised layer: FSDP gathers its weights there
        d, last = cfg.inner_dim, cfg.num_layers - 1
        self.pos_embed = layer(PatchEmbed)(cfg, dt, ops)
        self.time_text_embed = layer(_TimeText)(cfg, dt)
        self.context_embedder = layer(nn.Dense)(cfg.caption_projection_dim, dtype=dt,
                                                param_dtype=dt)  # fmt: skip
        scan.build(self, BLOCKS, self.kinds, lambda i: (layer(JointBlock), (
            cfg, i == last, i in cfg.dual_attention_layers, dt, ops, self.attn)),
            after=_text_read)  # fmt: skip
        self.norm_out = layer(AdaNormContinuous)(d, dt)
        p = cfg.patch_size
        self.proj_out = layer(nn.Dense)(p * p * cfg.out_channels, dtype=dt, param_dtype=dt)

    def __call__(
        self,
        sample: jax.Array,  # (B, h, W, C): the whole latent, or a row slab of it
        timesteps: jax.Array,  # (B,) or scalar: sigma in [0, 1] (x 1000 here, as diffusers'
        # SD3 pipeline passes it), the convention of every flow denoiser in patchpar
        encoder_hidden_states: jax.Array,  # (B, S, joint_attention_dim): CLIP-L|G and T5
        pooled_projections: jax.Array,  # (B, pooled_projection_dim): CLIP-L|G pooled
    ) -> jax.Array:  # (B, h, W, C)
        hs, aux = self.prologue(sample, timesteps, encoder_hidden_states, pooled_projections)
        return self.epilogue(self.blocks(0, self.num_blocks, hs, aux), aux)

    # The forward as prologue, blocks [lo, hi), epilogue: what a step cache runs apart
    # (`patchpar.sampling.cache`). After the last block the text tokens are None.

    @property
    def num_blocks(self) -> int:
        return self.config.num_layers

    @property
    def kinds(self) -> list[tuple[bool, bool]]:
        """Per block (the last, `context_pre_only`; a dual-attention block): blocks of one
        kind can share a scanned loop."""
        cfg = self.config
        last = cfg.num_layers - 1
        return [(i == last, i in cfg.dual_attention_layers) for i in range(cfg.num_layers)]

    def stack_params(self, params) -> dict:
        """Unrolled parameters in the scanned layout (`patchpar.models.scan.stack`)."""
        return scan.stack(params, BLOCKS, self.kinds)

    def prologue(self, sample, timesteps, encoder_hidden_states, pooled_projections):
        """-> ((image tokens, text tokens), aux)."""
        b, h, w, _ = sample.shape
        img = self.embed(sample)
        temb = self.time(timesteps, pooled_projections, b)
        txt = self.context(encoder_hidden_states)
        return (img, txt), (temb, (h, w))

    def blocks(self, lo: int, hi: int, hs, aux):
        """Joint blocks lo..hi-1 on (image, text) tokens."""
        (img, txt), (temb, (_, w)) = hs, aux
        row = w // self.config.patch_size
        one = lambda i, c: self.block(i, *c, temb, row)  # noqa: E731
        return scan.run(self, BLOCKS, self.kinds, lo, hi, (img, txt), (temb, row), one)

    def epilogue(self, hs, aux) -> jax.Array:
        temb, (h, w) = aux
        return self.head(hs[0], temb, h, w)

    def embed(self, sample: jax.Array) -> jax.Array:
        """(B, h, W, C) latent rows -> (B, h/p * W/p, D) image tokens with their positions."""
        return self.pos_embed(sample)

    def time(self, timesteps, pooled, batch: int) -> jax.Array:
        """(B, D) conditioning vector of every block's modulation and the output norm, from
        sigma (B,) and the pooled text."""
        t = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32) * 1000, (batch,))
        return self.time_text_embed(t, pooled)

    def context(self, encoder_hidden_states) -> jax.Array:
        """(B, S, D) text tokens."""
        return self.context_embedder(encoder_hidden_states.astype(self.dtype))

    def block(self, i: int, img, txt, temb, row: int):
        """Joint block i; the text tokens it leaves for the next go through the text-stream
        site (`ops.text_stream`); the last block (`context_pre_only`) leaves none."""
        if str(i) not in self.transformer_blocks:
            scan.refuse_apart(BLOCKS, i)
        img, txt = self.transformer_blocks[str(i)](img, txt, temb, row)
        return img, None if txt is None else self.ops.text_stream(self, txt)

    def head(self, img, temb, h: int, w: int) -> jax.Array:
        """(B, T, D) image tokens of an h x w latent slab -> (B, h, w, C)."""
        x = self.proj_out(self.norm_out(img, temb))
        p, c = self.config.patch_size, self.config.out_channels
        x = x.reshape(x.shape[0], h // p, w // p, p, p, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(x.shape[0], h, w, c)
