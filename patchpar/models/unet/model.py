"""Flax UNet2DConditionModel for SD 1.x, SD 2.x and SDXL (diffusers layout, NHWC)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from patchpar.models import scan
from patchpar.models.attention import AUTO, AttentionSpec
from patchpar.models.layers import (
    ATTENTION_AXES,
    Attention,
    Conv,
    Downsample2D,
    GroupNorm,
    ResnetBlock2D,
    TimestepEmbedding,
    Upsample2D,
    dense,
    timestep_embedding,
)
from patchpar.models.sites import IDENTITY, SiteOps
from patchpar.models.unet.config import UNetConfig

BLOCKS = "transformer_blocks"  # a Transformer2DModel's blocks: transformer_blocks_<i>


class FeedForward(nn.Module):
    """GEGLU feed-forward: net.0.proj -> (h, gate) -> h * gelu(gate) -> net.2. Tensor parallel:
    each device holds its share of h and of the gate (`parallel.rules` lays the projection
    out so), and net.2 is row-split."""

    dim: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        inner = 4 * self.dim // self.ops.model_degree()
        h, gate = jnp.split(GegluProj(2 * inner, self.dtype, name="net_0")(x), 2, axis=-1)
        out = h * nn.gelu(gate, approximate=False)
        return dense(self.dim, "net_2", self.dtype, ops=self.ops)(out)


class GegluProj(nn.Module):
    features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return dense(self.features, "proj", self.dtype)(x)


class BasicTransformerBlock(nn.Module):
    dim: int
    heads: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array, row: int | None = None) -> jax.Array:
        # x (B, T, C); row: tokens per image row (W)
        def ln(name: str) -> nn.LayerNorm:
            return nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, param_dtype=self.dtype, name=name)

        dh = self.dim // self.heads
        x = (
            Attention(
                self.heads,
                dh,
                self.dim,
                dtype=self.dtype,
                ops=self.ops,
                attn=self.attn,
                name="attn1",
            )(ln("norm1")(x), row=row)
            + x
        )
        x = (
            Attention(
                self.heads,
                dh,
                self.dim,
                dtype=self.dtype,
                ops=self.ops,  # cross-attention: no site, but its heads split as attn1's
                attn=self.attn,
                name="attn2",
            )(ln("norm2")(x), context)
            + x
        )
        return FeedForward(self.dim, self.dtype, self.ops, name="ff")(ln("norm3")(x)) + x


class Transformer2DModel(nn.Module):
    channels: int
    heads: int
    num_layers: int
    use_linear_projection: bool
    groups: int = 32
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False  # a transformer's blocks as one scanned loop (`models.scan`)

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:  # (B, h, W, C)
        b, h, w, c = x.shape
        res = x
        layer, dt = self.ops.layer, self.dtype
        x = layer(GroupNorm)(self.groups, 1e-6, dt, self.ops, name="norm")(x)
        if self.use_linear_projection:
            x = layer(nn.Dense)(c, dtype=dt, param_dtype=dt, name="proj_in")(x.reshape(b, h * w, c))
        else:
            x = layer(Conv)(c, 1, padding=0, dtype=dt, name="proj_in")(x).reshape(b, h * w, c)
        fields = (c, self.heads, dt, self.ops, self.attn)
        if self.scan and self.num_layers > 1:
            (x,) = scan.Layers(BasicTransformerBlock, fields, self.num_layers, self.ops,
                               name=scan.key(BLOCKS, 0))((x,), context, w)  # fmt: skip
        for i in range(0 if self.scan and self.num_layers > 1 else self.num_layers):
            x = layer(BasicTransformerBlock)(*fields, name=f"{BLOCKS}_{i}")(x, context, w)
        if self.use_linear_projection:
            x = layer(nn.Dense)(c, dtype=dt, param_dtype=dt, name="proj_out")(x)
            x = x.reshape(b, h, w, c)
        else:
            x = layer(Conv)(c, 1, padding=0, dtype=dt, name="proj_out")(x.reshape(b, h, w, c))
        return x + res


def _resnet(cfg: UNetConfig, channels: int, dtype, ops, name: str) -> ResnetBlock2D:
    block = ops.layer(ResnetBlock2D)
    return block(channels, cfg.norm_num_groups, cfg.norm_eps, True, dtype, ops, name=name)


def _transformer(
    cfg: UNetConfig, level: int, dtype, ops, attn, name: str, scan_blocks: bool = False
) -> Transformer2DModel:
    """The transformer of resolution level `level` (heads and depth are per level)."""
    return Transformer2DModel(
        cfg.block_out_channels[level],
        cfg.heads[level],
        cfg.transformer_layers_per_block[level],
        cfg.use_linear_projection,
        cfg.norm_num_groups,
        dtype,
        ops,
        attn,
        scan_blocks,
        name=name,
    )


class DownBlock(nn.Module):
    """CrossAttnDownBlock2D / DownBlock2D: returns the output and its skip connections. Its
    layers and its downsampler are apart (`layers`, `down`): the UNet's forward counts them
    as two blocks (a step cache that reuses the deeper levels skips the downsampler)."""

    cfg: UNetConfig
    index: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False

    def setup(self):
        cfg, i, dt, ops = self.cfg, self.index, self.dtype, self.ops
        c = cfg.block_out_channels[i]
        cross = cfg.down_block_types[i] == "CrossAttnDownBlock2D"
        self.resnets = [_resnet(cfg, c, dt, ops, None) for _ in range(cfg.layers_per_block)]
        self.attentions = [
            _transformer(cfg, i, dt, ops, self.attn, None, self.scan)
            for _ in range(cfg.layers_per_block if cross else 0)
        ]
        last = i == len(cfg.block_out_channels) - 1
        down = ops.layer(Downsample2D)
        self.downsamplers = [] if last else [down(c, cfg.downsample_padding, dt, ops)]

    @property
    def downsamples(self) -> bool:
        return self.index < len(self.cfg.block_out_channels) - 1

    def __call__(self, x, emb, ctx) -> tuple[jax.Array, list[jax.Array]]:
        x, skips = self.layers(x, emb, ctx)
        if self.downsamples:
            x = self.down(x)
            skips.append(x)
        return x, skips

    def layers(self, x, emb, ctx) -> tuple[jax.Array, list[jax.Array]]:
        """The ResNets (and transformers): the output and a skip connection after each."""
        skips = []
        for j, resnet in enumerate(self.resnets):
            x = resnet(x, emb)
            if self.attentions:
                x = self.attentions[j](x, ctx)
            skips.append(x)
        return x, skips

    def down(self, x) -> jax.Array:
        return self.downsamplers[0](x)


class MidBlock(nn.Module):
    """UNetMidBlock2DCrossAttn: resnet, transformer, resnet."""

    cfg: UNetConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False

    @nn.compact
    def __call__(self, x, emb, ctx) -> jax.Array:
        cfg, dt, ops = self.cfg, self.dtype, self.ops
        c = cfg.block_out_channels[-1]
        x = _resnet(cfg, c, dt, ops, "resnets_0")(x, emb)
        x = _transformer(
            cfg, len(cfg.block_out_channels) - 1, dt, ops, self.attn, "attentions_0", self.scan
        )(x, ctx)
        return _resnet(cfg, c, dt, ops, "resnets_1")(x, emb)


class UpBlock(nn.Module):
    """CrossAttnUpBlock2D / UpBlock2D: consumes layers_per_block + 1 skip connections."""

    cfg: UNetConfig
    index: int
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False

    @nn.compact
    def __call__(self, x, skips: list[jax.Array], emb, ctx) -> jax.Array:
        cfg, i, dt, ops = self.cfg, self.index, self.dtype, self.ops
        n = len(cfg.block_out_channels)
        bi = n - 1 - i  # the matching down block: heads and transformer depth are reversed
        c = cfg.block_out_channels[bi]
        for j in range(cfg.layers_per_block + 1):
            x = jnp.concatenate([x, skips.pop()], axis=-1)  # (B, h, W, C + Cskip)
            x = _resnet(cfg, c, dt, ops, f"resnets_{j}")(x, emb)
            if cfg.up_block_types[i] == "CrossAttnUpBlock2D":
                x = _transformer(cfg, bi, dt, ops, self.attn, f"attentions_{j}", self.scan)(x, ctx)
        if i < n - 1:
            x = ops.layer(Upsample2D)(c, dt, ops, name="upsamplers_0")(x)
        return x


_RESNET = r"resnets_\d+/"
# The UNet's logical axes (`parallel.rules`): GEGLU feed-forwards, ResNet middle channels, the
# latent output channels; any other kernel is (..., conv_in, embed), a bias or scale (embed,).
LOGICAL: tuple[tuple[str, tuple], ...] = ATTENTION_AXES + (
    (r"ff/net_0/proj/kernel$", ("embed", "mlp_gated")),
    (r"ff/net_0/proj/bias$", ("mlp_gated",)),
    (r"ff/net_2/kernel$", ("mlp", "embed")),
    (_RESNET + r"conv1/kernel$", (None, None, "embed", "conv_mid")),
    (_RESNET + r"(conv1|time_emb_proj|norm2)/(bias|scale)$", ("conv_mid",)),
    (_RESNET + r"time_emb_proj/kernel$", ("embed", "conv_mid")),
    (_RESNET + r"conv2/kernel$", (None, None, "conv_mid", "embed")),
    (r"(^|/)conv_out/kernel$", (None, None, "embed", "conv_out")),
    (r"(^|/)conv_out/bias$", ("conv_out",)),
)


class UNet2DConditionModel(nn.Module):
    """diffusers UNet2DConditionModel. Runs unchanged on a row slab; sites go through `ops`."""

    config: UNetConfig
    dtype: jnp.dtype = jnp.float32
    ops: SiteOps = IDENTITY
    attn: AttentionSpec = AUTO
    scan: bool = False  # each transformer's blocks as one scanned loop (`models.scan`)

    def stack_params(self, params) -> dict:
        """Unrolled parameters in the scanned layout: each transformer's blocks stacked."""
        return scan.stack_nested(params, BLOCKS)

    def setup(self):
        cfg, dt, ops = self.config, self.dtype, self.ops
        boc = cfg.block_out_channels
        layer = ops.layer  # every parameterised layer: FSDP gathers its weights there
        self.time_embedding = layer(TimestepEmbedding)(4 * boc[0], dt)
        if cfg.addition_embed_type == "text_time":
            self.add_embedding = layer(TimestepEmbedding)(4 * boc[0], dt)
        # The model's input is exact every step: its halo comes fresh even for stale strategies.
        self.conv_in = layer(Conv)(boc[0], dtype=dt, ops=ops.input_layer())
        sc = self.scan
        self.down_blocks = [DownBlock(cfg, i, dt, ops, self.attn, sc) for i in range(len(boc))]
        self.mid_block = MidBlock(cfg, dt, ops, self.attn, sc)
        self.up_blocks = [UpBlock(cfg, i, dt, ops, self.attn, sc) for i in range(len(boc))]
        self.conv_norm_out = layer(GroupNorm)(cfg.norm_num_groups, cfg.norm_eps, dt, ops)
        self.conv_out = layer(Conv)(cfg.out_channels, dtype=dt, ops=ops)

    def __call__(
        self,
        sample: jax.Array,  # (B, h, W, Cin): the whole latent, or a row slab of it
        timesteps: jax.Array,  # (B,) or scalar
        encoder_hidden_states: jax.Array,  # (B, S, D)
        text_embeds: jax.Array | None = None,  # (B, P) SDXL pooled text embedding
        time_ids: jax.Array | None = None,  # (B, 6) SDXL size/crop conditioning
    ) -> jax.Array:  # (B, h, W, Cout)
        hs, aux = self.prologue(sample, timesteps, encoder_hidden_states, text_embeds, time_ids)
        return self.epilogue(self.blocks(0, self.num_blocks, hs, aux), aux)

    # The forward as prologue, blocks [lo, hi), epilogue, for a strategy that splits the layers
    # (AsyncDiff) and a step cache that reuses the deep levels (DeepCache). The blocks are, in
    # order, each level's down layers and its downsampler (none at the last level), the mid
    # block and the up blocks; `hs` is (x, the skip connections not yet consumed): the skips
    # travel with the activation.

    def _units(self) -> list[tuple[str, int]]:
        n = len(self.config.block_out_channels)
        down = [u for i in range(n) for u in [("down", i)] + [("downsample", i)] * (i < n - 1)]
        return down + [("mid", 0)] + [("up", i) for i in range(n)]

    @property
    def num_blocks(self) -> int:
        return 3 * len(self.config.block_out_channels)

    @property
    def levels(self) -> int:
        return len(self.config.block_out_channels)

    def branch_bounds(self, branch: int) -> tuple[int, int]:
        """DeepCache's shallow branch `branch` (0: the shallowest level): the blocks [0, lo)
        and [hi, num_blocks) that run every step; [lo, hi) are reused (the branch level's
        downsampler, the levels below and the mid block; at the deepest branch the mid
        block alone). The reused blocks consume as many skip connections as they add."""
        return 2 * branch + 1, self.num_blocks - branch - 1

    def prologue(self, sample, timesteps, encoder_hidden_states, text_embeds=None, time_ids=None):
        """-> ((conv_in's output, (it as the first skip,)), (time embedding, text context))."""
        cfg, dt = self.config, self.dtype
        boc = cfg.block_out_channels
        b = sample.shape[0]
        timesteps = jnp.broadcast_to(jnp.asarray(timesteps), (b,))
        temb = timestep_embedding(timesteps, boc[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        emb = self.time_embedding(temb)  # (B, 4*C0)
        if cfg.addition_embed_type == "text_time":
            if text_embeds is None or time_ids is None:
                raise ValueError(
                    "this UNet has addition_embed_type='text_time' (SDXL): pass text_embeds and time_ids"
                )
            tid = timestep_embedding(
                time_ids.reshape(-1),
                cfg.addition_time_embed_dim,
                cfg.flip_sin_to_cos,
                cfg.freq_shift,
            ).reshape(b, -1)  # (B, 6 * addition_time_embed_dim)
            add = jnp.concatenate([text_embeds.astype(jnp.float32), tid], axis=-1)
            emb = emb + self.add_embedding(add)
        ctx = encoder_hidden_states.astype(dt)
        x = self.conv_in(sample.astype(dt))
        return (x, (x,)), (emb, ctx)

    def blocks(self, lo: int, hi: int, hs, aux):
        """Blocks lo..hi-1 (down layers and downsamplers, mid block, up blocks) on (x,
        skips)."""
        (x, skips), (emb, ctx) = hs, aux
        skips = list(skips)
        take = self.config.layers_per_block + 1
        for kind, i in self._units()[lo:hi]:
            if kind == "down":
                x, s = self.down_blocks[i].layers(x, emb, ctx)
                skips += s
            elif kind == "downsample":
                x = self.down_blocks[i].down(x)
                skips.append(x)
            elif kind == "mid":
                x = self.mid_block(x, emb, ctx)
            else:
                x = self.up_blocks[i](x, skips[-take:], emb, ctx)
                skips = skips[:-take]
        return x, tuple(skips)

    def epilogue(self, hs, aux) -> jax.Array:
        del aux
        return self.conv_out(nn.silu(self.conv_norm_out(hs[0])))
