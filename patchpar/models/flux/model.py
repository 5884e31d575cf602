"""Flax FLUX.1 transformer (diffusers' `FluxTransformer2DModel` layout), called on the unpacked
NHWC latent.

The latent (B, H, W, 16) is packed 2 x 2 into H/2 x W/2 tokens of 64 channels (channel-major
within a token, as diffusers' `_pack_latents`) and embedded (`x_embedder`); the T5 states are
projected (`context_embedder`); the timestep (x 1000), the guidance scale (x 1000, dev only) and
the pooled CLIP embedding make one conditioning vector `temb`. Then `num_layers` double-stream
blocks (separate image and text projections, norms and feed-forwards; RMSNorm on Q and K; one
joint attention over [text; image]) and `num_single_layers` single-stream blocks (the joined
sequence, attention and MLP in parallel), each modulated by adaLN-Zero from `temb`; the output
is AdaLayerNormContinuous, `proj_out`, and unpacking back to (B, H, W, 16).

Positions are 3-axis RoPE: text ids are zeros (their rotation is the identity), image token
(r, c) has ids (0, r, c); `axes_dims_rope` (16, 56, 56) of each head's dims rotate by each id
at frequencies theta^(-2k/d) (theta 10000). The table of the whole token grid comes through
`ops.positions`, so a row slab rotates by its global rows.

On a row slab (rows a multiple of 2: whole tokens) only two things are global: the positions
and the image keys/values of each joint attention (the site `ops.joint_attention`: the image
part of the keys is exchanged, the text part stays local). Every device holds the whole text
stream and computes it itself.
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
    AdaNormContinuous,
    GeluFeedForward,
    Modulation,
    RMSNorm,
    SiluProjection,
    TimestepEmbedding,
    apply_rope,
    dense,
    layer_norm,
    rope_of_ids,
    timestep_embedding,
)
from patchpar.models.sites import IDENTITY, SiteOps

CLASS_NAMES = ("FluxTransformer2DModel",)
DOUBLES, SINGLES = "transformer_blocks", "single_transformer_blocks"
DOUBLE = DOUBLES + "_{}"  # the double-stream blocks' parameter names, layer i
SINGLE = SINGLES + "_{}"  # the single-stream blocks'
# FLUX's logical axes (`parallel.rules`): heads in every Q/K/V projection, the feed-forwards'
# and the single blocks' MLP widths. A single block's proj_mlp (4 x width) and proj_out (its
# input [attention (width) | MLP (4 x width)]) are laid out as 4 and 5 parts of the width, each
# split alike: a device's MLP share is then the same columns in both, and its proj_out rows are
# its [attention heads | MLP] shares in the order it joins them.
LOGICAL: tuple[tuple[str, tuple], ...] = (
    (r"attn/(to_[qkv]|add_[qkv]_proj)/kernel$", ("embed", "heads")),
    (r"attn/(to_[qkv]|add_[qkv]_proj)/bias$", ("heads",)),
    (r"attn/(to_out_0|to_add_out)/kernel$", ("heads", "embed")),
    (r"ff(_context)?/net_0/proj/kernel$", ("embed", "mlp")),
    (r"ff(_context)?/net_0/proj/bias$", ("mlp",)),
    (r"ff(_context)?/net_2/kernel$", ("mlp", "embed")),
    (r"proj_mlp/kernel$", ("embed", "mlp*4")),
    (r"proj_mlp/bias$", ("mlp*4",)),
    (r"single_transformer_blocks_\d+/proj_out/kernel$", ("mlp*5", "embed")),
)
_KEYS = {
    "patch_size",
    "in_channels",
    "out_channels",
    "num_layers",
    "num_single_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "pooled_projection_dim",
    "guidance_embeds",
    "axes_dims_rope",
}


@dataclass(frozen=True)
class FluxConfig:
    """The parts of a diffusers FluxTransformer2DModel config.json that shape the network."""

    in_channels: int = 64  # a packed token: 4 x the latent's channels
    out_channels: int = 64
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    sample_size: int = 128  # latent pixels of the default image (1024 px with the VAE's 8)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def latent_channels(self) -> int:
        return self.in_channels // 4

    @classmethod
    def from_diffusers(cls, cfg: dict, where: str = "transformer/config.json") -> FluxConfig:
        """Parse and validate; another architecture or an unsupported value raises ValueError."""
        name = cfg.get("_class_name", CLASS_NAMES[0])
        if name not in CLASS_NAMES:
            raise ValueError(f"{where}: _class_name={name!r} is not {CLASS_NAMES[0]}")
        if cfg.get("patch_size", 1) != 1:
            raise ValueError(
                f"{where}: patch_size={cfg['patch_size']} is not supported (FLUX.1 packs 2 x 2 "
                f"latent pixels per token outside the transformer and has patch_size 1)"
            )
        in_ch = cfg.get("in_channels", 64)
        out_ch = cfg.get("out_channels") or in_ch
        if in_ch % 4 or out_ch != in_ch:
            raise ValueError(
                f"{where}: in_channels={in_ch}, out_channels={out_ch}: a FLUX.1 transformer "
                f"takes and gives 2 x 2 packed latents (in_channels = out_channels = 4 x the "
                f"latent's channels; FLUX.1-Fill/Depth with extra inputs are not supported)"
            )
        head = cfg.get("attention_head_dim", 128)
        axes = tuple(cfg.get("axes_dims_rope", (16, 56, 56)))
        if sum(axes) != head or any(d % 2 for d in axes) or len(axes) != 3:
            raise ValueError(
                f"{where}: axes_dims_rope={list(axes)} must be 3 even sizes summing to "
                f"attention_head_dim={head}"
            )
        return cls(
            in_channels=in_ch,
            out_channels=out_ch,
            num_layers=cfg.get("num_layers", 19),
            num_single_layers=cfg.get("num_single_layers", 38),
            attention_head_dim=head,
            num_attention_heads=cfg.get("num_attention_heads", 24),
            joint_attention_dim=cfg.get("joint_attention_dim", 4096),
            pooled_projection_dim=cfg.get("pooled_projection_dim", 768),
            guidance_embeds=bool(cfg.get("guidance_embeds", False)),
            axes_dims_rope=axes,
            sample_size=cfg.get("sample_size", 128),
            extra=dict(cfg),
        )


def rope_table(config: FluxConfig, rows: int, cols: int, theta: float = 10000.0) -> np.ndarray:
    """(rows x cols, 2 x head_dim) float32 [cos | sin] of a rows x cols grid of image tokens with
    ids (0, r, c), as diffusers' FluxPosEmbed computes them (float64 angles, each frequency's
    cos and sin repeated for its pair of dims). A constant: exact strategies stay
    bit-identical to one device."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    ids = np.stack([np.zeros(r.size), r.reshape(-1), c.reshape(-1)], axis=1).astype(np.float32)
    return rope_of_ids(ids, config.axes_dims_rope, theta)


class JointAttention(nn.Module):
    """diffusers FluxAttention: Q/K/V of the image tokens (to_q/k/v) and, in a double block, of
    the text tokens (add_q/k/v_proj), RMSNorm per head on Q and K, RoPE on the image tokens,
    one attention over [text; image] through the site `ops.joint_attention`. A double block's
    outputs go through to_out.0 (image) and to_add_out (text); a single block's (`pre_only`)
    come back as they are, joined."""

    heads: int
    dim_head: int
    dim: int
    pre_only: bool = False  # a single-stream block's attention: x is [text; image] joined
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, img, txt, rope, row: int):
        # img (B, T, D): this slab's image tokens; txt (B, S, D): the text tokens (None in a
        # single block, where img holds [text; image] and `txt_len` = S comes from rope's rows)
        heads = -(-self.heads // self.ops.model_degree())  # tensor parallel: this device's heads
        inner, dt, hd = heads * self.dim_head, self.dtype, self.dim_head

        def project(x, names, norms):
            q, k, v = (dense(inner, n, dt)(x) for n in names)
            split = lambda a: a.reshape(*a.shape[:-1], heads, hd)  # noqa: E731
            q = RMSNorm(1e-6, dt, name=norms[0])(split(q))
            k = RMSNorm(1e-6, dt, name=norms[1])(split(k))
            return q, k, split(v)

        if self.pre_only:  # single block: one projection of the joined sequence
            s = img.shape[1] - rope.shape[0]
            q, k, v = project(img, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
            qt, kt, vt = q[:, :s], k[:, :s], v[:, :s]
            qi, ki, vi = q[:, s:], k[:, s:], v[:, s:]
        else:
            s = txt.shape[1]
            qi, ki, vi = project(img, ("to_q", "to_k", "to_v"), ("norm_q", "norm_k"))
            qt, kt, vt = project(
                txt, ("add_q_proj", "add_k_proj", "add_v_proj"), ("norm_added_q", "norm_added_k")
            )
        qi, ki = apply_rope(qi, rope), apply_rope(ki, rope)  # text ids are 0: no rotation
        flat = lambda a: a.reshape(*a.shape[:2], inner)  # noqa: E731
        q = jnp.concatenate([flat(qt), flat(qi)], axis=1)
        out = self.ops.joint_attention(
            self, q, flat(kt), flat(vt), flat(ki), flat(vi), heads, self.attn, row
        )  # (B, S + T, inner)
        if self.pre_only:
            return out
        img_out = dense(self.dim, "to_out_0", dt, ops=self.ops)(out[:, s:])
        txt_out = dense(self.dim, "to_add_out", dt, ops=self.ops)(out[:, :s])
        return img_out, txt_out


class DoubleBlock(nn.Module):
    """FluxTransformerBlock: image and text streams each with adaLN-Zero (norm1,
    norm1_context), the joint attention, and each its own feed-forward (ff, ff_context)."""

    config: FluxConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, img, txt, temb, rope, row: int, modulated_only: bool = False):
        """-> (image, text) tokens; `modulated_only`: the image stream's modulated input to
        the attention alone (what TeaCache watches)."""
        cfg, dt, d = self.config, self.dtype, self.config.inner_dim
        mi = Modulation(6, d, dt, name="norm1")(temb)[:, :, None]  # (B, 6, 1, D)
        hi = layer_norm(img) * (1 + mi[:, 1]) + mi[:, 0]
        if modulated_only:
            return hi
        mt = Modulation(6, d, dt, name="norm1_context")(temb)[:, :, None]
        ht = layer_norm(txt) * (1 + mt[:, 1]) + mt[:, 0]
        attn = JointAttention(
            cfg.num_attention_heads, cfg.attention_head_dim, d, False, dt, self.ops, self.attn,
            name="attn",
        )  # fmt: skip
        ai, at = attn(hi, ht, rope, row)
        img = img + mi[:, 2] * ai
        h = layer_norm(img) * (1 + mi[:, 4]) + mi[:, 3]
        img = img + mi[:, 5] * GeluFeedForward(d, dt, self.ops, name="ff")(h)
        txt = txt + mt[:, 2] * at
        h = layer_norm(txt) * (1 + mt[:, 4]) + mt[:, 3]
        txt = txt + mt[:, 5] * GeluFeedForward(d, dt, self.ops, name="ff_context")(h)
        return img, txt


class SingleBlock(nn.Module):
    """FluxSingleTransformerBlock on [text; image] joined: adaLN-Zero (norm), then attention
    and a tanh-GELU MLP in parallel, their outputs joined and projected (proj_out)."""

    config: FluxConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, img, txt, temb, rope, row: int):
        cfg, dt, d = self.config, self.dtype, self.config.inner_dim
        s = txt.shape[1]
        x = jnp.concatenate([txt, img], axis=1)
        m = Modulation(3, d, dt, name="norm")(temb)[:, :, None]
        h = layer_norm(x) * (1 + m[:, 1]) + m[:, 0]
        mlp = nn.gelu(dense(4 * d // self.ops.model_degree(), "proj_mlp", dt)(h), approximate=True)
        a = JointAttention(
            cfg.num_attention_heads, cfg.attention_head_dim, d, True, dt, self.ops, self.attn,
            name="attn",
        )(h, None, rope, row)  # fmt: skip
        # [attention | MLP] joined into one projection; under tensor parallelism its input is
        # this device's share of both (`LOGICAL`: proj_out rows of 5 parts), summed over model
        out = dense(d, "proj_out", dt, ops=self.ops)(jnp.concatenate([a, mlp], axis=-1))
        x = x + m[:, 2] * out
        return x[:, s:], x[:, :s]


class _PosEmbed(nn.Module):
    """diffusers FluxPosEmbed (no parameters): the RoPE table of this slab's image tokens."""

    config: FluxConfig
    ops: SiteOps = IDENTITY

    def __call__(self, rows: int, cols: int) -> jax.Array:
        return self.ops.positions(self, lambda r, c: rope_table(self.config, r, c), rows, cols)


# TeaCache4FLUX's published rescaling polynomial (ali-vilab/TeaCache, FLUX.1-dev), highest power
# first: the first block's modulated input's relative L1 change -> the output's
TEACACHE_COEFFICIENTS = (
    4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01,
)  # fmt: skip


class FluxTransformer2DModel(nn.Module):
    """diffusers FluxTransformer2DModel on the unpacked latent. Runs unchanged on a row slab
    (rows a multiple of 2); the sites go through `ops`. The forward is its parts in order:
    `embed` (packing, x_embedder, RoPE rows), `time`, `context`, `double` block i, `single`
    block i, `head` (norm_out, proj_out, unpacking)."""

    config: FluxConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False  # each stack of identical blocks as one scanned loop (`models.scan`)

    teacache_coefficients = TEACACHE_COEFFICIENTS  # the `teacache` cache's rescaling

    def setup(self):
        cfg, dt, ops = self.config, self.dtype, self.ops
        layer = ops.layer  # every parameterised layer: FSDP gathers its weights there
        d = cfg.inner_dim
        self.pos_embed = _PosEmbed(cfg, ops)
        self.x_embedder = layer(nn.Dense)(d, dtype=dt, param_dtype=dt)
        self.time_text_embed = layer(_TimeText)(cfg, dt)
        self.context_embedder = layer(nn.Dense)(d, dtype=dt, param_dtype=dt)
        kinds = self.kinds
        scan.build(self, DOUBLES, kinds[0], lambda i: (layer(DoubleBlock), (cfg, dt, ops, self.attn)),
                   after=_text_read)  # fmt: skip
        scan.build(self, SINGLES, kinds[1], lambda i: (layer(SingleBlock), (cfg, dt, ops, self.attn)),
                   after=_text_read)  # fmt: skip
        self.norm_out = layer(AdaNormContinuous)(d, dt)
        self.proj_out = layer(nn.Dense)(cfg.out_channels, dtype=dt, param_dtype=dt)

    def __call__(
        self,
        sample: jax.Array,  # (B, h, W, C): the whole latent, or a row slab of it
        timesteps: jax.Array,  # (B,) or scalar: sigma in [0, 1], as diffusers' transformer
        encoder_hidden_states: jax.Array,  # (B, S, joint_attention_dim): the T5 states
        pooled_projections: jax.Array,  # (B, pooled_projection_dim): CLIP's pooled output
        guidance: jax.Array | None = None,  # (B,) the guidance scale (dev), None (schnell)
    ) -> jax.Array:  # (B, h, W, C)
        hs, aux = self.prologue(sample, timesteps, encoder_hidden_states, pooled_projections,
                                guidance)  # fmt: skip
        return self.epilogue(self.blocks(0, self.num_blocks, hs, aux), aux)

    # The forward as prologue, blocks [lo, hi) (the double blocks, then the single ones),
    # epilogue: what a step cache runs apart (`patchpar.sampling.cache`).

    @property
    def num_blocks(self) -> int:
        return self.config.num_layers + self.config.num_single_layers

    @property
    def kinds(self) -> tuple[list[bool], list[bool]]:
        """Per double and per single block, whether a later block reads its text tokens (all
        but the last block): blocks of one kind can share a scanned loop."""
        last, n = self.num_blocks - 1, self.config.num_layers
        return [j < last for j in range(n)], [
            n + j < last for j in range(self.config.num_single_layers)
        ]

    def stack_params(self, params) -> dict:
        """Unrolled parameters in the scanned layout (`patchpar.models.scan.stack`)."""
        doubles, singles = self.kinds
        return scan.stack(scan.stack(params, DOUBLES, doubles), SINGLES, singles)

    def prologue(self, sample, timesteps, encoder_hidden_states, pooled_projections,
                 guidance=None):  # fmt: skip
        """-> ((image tokens, text tokens), aux)."""
        b, h, w, _ = sample.shape
        img, rope = self.embed(sample)
        temb = self.time(timesteps, guidance, pooled_projections, b)
        txt = self.context(encoder_hidden_states)
        return (img, txt), (temb, rope, (h, w))

    def blocks(self, lo: int, hi: int, hs, aux):
        """Blocks lo..hi-1 of the double-then-single order on (image, text) tokens."""
        (img, txt), (temb, rope, (_, w)) = hs, aux
        n, last = self.config.num_layers, self.num_blocks - 1
        shared = (temb, rope, w // 2)

        def one(run, offset):
            return lambda i, c: run(i, *c, temb, rope, w // 2, offset + i < last)

        kinds = self.kinds
        carry = (img, txt)
        if lo < n:
            carry = scan.run(self, DOUBLES, kinds[0], lo, min(hi, n), carry, shared,
                             one(self.double, 0))  # fmt: skip
        if hi > n:
            carry = scan.run(self, SINGLES, kinds[1], max(lo, n) - n, hi - n, carry, shared,
                             one(self.single, n))  # fmt: skip
        return carry

    def epilogue(self, hs, aux) -> jax.Array:
        temb, _, (h, w) = aux
        return self.head(hs[0], temb, h, w)

    def modulated(self, hs, aux) -> jax.Array:
        """The first block's modulated image input (B, T, D): what TeaCache compares."""
        (img, txt), (temb, rope, (_, w)) = hs, aux
        if "0" not in self.transformer_blocks:
            scan.refuse_apart(DOUBLES, 0)
        return self.transformer_blocks["0"](img, txt, temb, rope, w // 2, modulated_only=True)

    def embed(self, sample: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(B, h, W, C) latent rows -> ((B, h/2 * W/2, D) image tokens, their RoPE table)."""
        b, h, w, c = sample.shape
        x = sample.astype(self.dtype).reshape(b, h // 2, 2, w // 2, 2, c)
        x = x.transpose(0, 1, 3, 5, 2, 4).reshape(b, (h // 2) * (w // 2), 4 * c)
        return self.x_embedder(x), self.pos_embed(h // 2, w // 2)

    def time(self, timesteps, guidance, pooled, batch: int) -> jax.Array:
        """(B, D) conditioning vector of every block's modulation and the output norm."""
        t = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32), (batch,))
        g = None if guidance is None else jnp.broadcast_to(jnp.asarray(guidance, jnp.float32),
                                                           (batch,))  # fmt: skip
        return self.time_text_embed(t, g, pooled)

    def context(self, encoder_hidden_states) -> jax.Array:
        """(B, S, D) text tokens."""
        return self.context_embedder(encoder_hidden_states.astype(self.dtype))

    def double(self, i: int, img, txt, temb, rope, row: int, text_read: bool = True):
        """Double block i; `text_read`: a later block reads its text tokens, so the copy
        this device keeps goes through the text-stream site (`ops.text_stream`)."""
        if str(i) not in self.transformer_blocks:
            scan.refuse_apart(DOUBLES, i)
        img, txt = self.transformer_blocks[str(i)](img, txt, temb, rope, row)
        return img, self.ops.text_stream(self, txt) if text_read else txt

    def single(self, i: int, img, txt, temb, rope, row: int, text_read: bool = True):
        """Single block i (the last block's text tokens are read by nothing)."""
        if str(i) not in self.single_transformer_blocks:
            scan.refuse_apart(SINGLES, i)
        img, txt = self.single_transformer_blocks[str(i)](img, txt, temb, rope, row)
        return img, self.ops.text_stream(self, txt) if text_read else txt

    def head(self, img, temb, h: int, w: int) -> jax.Array:
        """(B, T, D) image tokens of an h x w latent slab -> (B, h, w, C)."""
        x = self.proj_out(self.norm_out(img, temb))
        b, c = x.shape[0], self.config.out_channels // 4
        x = x.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
        return x.reshape(b, h, w, c)


def _text_read(ops: SiteOps, block, out):
    """A scanned block's output as the next block reads it: its text tokens through the
    text-stream site (`FluxTransformer2DModel.double`)."""
    img, txt = out
    return img, ops.text_stream(block, txt)


class _TimeText(nn.Module):  # the parameter layout of CombinedTimestep(Guidance)TextProjEmbeddings
    config: FluxConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, timesteps, guidance, pooled):
        cfg, dt = self.config, self.dtype
        # diffusers scales by 1000 in the model's dtype, then embeds in float32
        t = timesteps.astype(dt) * 1000
        emb = TimestepEmbedding(cfg.inner_dim, dt, name="timestep_embedder")(
            timestep_embedding(t, 256, True, 0.0)
        )
        if cfg.guidance_embeds:
            if guidance is None:
                raise ValueError(
                    "this FLUX transformer embeds the guidance scale (guidance_embeds: FLUX.1-dev "
                    "and its distillations); pass guidance (B,)"
                )
            emb = emb + TimestepEmbedding(cfg.inner_dim, dt, name="guidance_embedder")(
                timestep_embedding(guidance.astype(dt) * 1000, 256, True, 0.0)
            )
        return emb + SiluProjection(cfg.inner_dim, dt, name="text_embedder")(pooled)
