"""The three spatial sites of a UNet / VAE, behind one small interface (docs/design.md §2).

Everything else in the models is per-pixel or per-token and runs unchanged on a row slab.
Model code calls a `SiteOps` object at exactly three places:

1. `halo`: a spatial convolution needs `top` / `bottom` extra rows around its input (the
   first convolution, on the sampler's latent, takes `input_layer()`'s ops: always exact);
2. `group_stats`: GroupNorm needs global per-group E[x] and E[x^2];
3. `self_attention`: self-attention queries need keys/values of the whole image. By default
   the site gathers them (`self_attn_kv`: all of them, or for PCPP the neighbouring bands, with
   a key mask for slots that do not exist on an edge device) and runs the kernel locally;
   context-parallel strategies (Ring, Ulysses) answer the whole attention instead. An MMDiT's
   `joint_attention` is the same site with the text tokens' keys/values (local on every
   device) in front of the image's.

Two non-spatial calls serve the weights: tensor parallelism's `model_degree` (how many ways
weights are split) and `model_sum` (the all-reduce after a row-split layer), and `layer`, the
class every parameterised layer of the UNet is built from (FSDP gathers the layer's sharded
weights there, just before it runs).

`SiteOps` itself is the single-device (identity) implementation: zero padding, local
statistics, local K/V, unsplit weights. The parallel layer subclasses it; the ops object is a static, hashable
attribute of every module, and the calling module is passed in so that an implementation can
keep per-site state in a Flax variable collection (`mod.variable("stale", ...)`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from patchpar.models.attention import AttentionSpec, attend, attend_joint


@dataclass(frozen=True)
class SiteOps:
    """Identity site ops: the whole image is local."""

    def halo(self, mod, x: jax.Array, top: int, bottom: int) -> jax.Array:
        """Rows above/below the local slab for a spatial conv. x: (B, h, W, C) -> (B, top+h+bottom, W, C)."""
        del mod
        return jnp.pad(x, ((0, 0), (top, bottom), (0, 0), (0, 0)))

    def group_stats(self, mod, mean: jax.Array, mean_sq: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Global per-group E[x], E[x^2] from the local ones. Each (B, G), float32."""
        del mod
        return mean, mean_sq

    def own_rows(self, h: int) -> jax.Array | None:
        """Of a local slab of `h` rows, how many are this device's patch's (the rest padding:
        uneven patches, `parallel.split`); None: all of them."""
        del h
        return None

    def self_attn_kv(
        self, mod, k: jax.Array, v: jax.Array, row: int | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Keys/values the local queries attend to, from the local ones: each (B, h*W, D) ->
        (B, T, D), and a (T,) bool mask of the keys that exist (None = all). `row`: tokens per
        image row (W; a DiT's columns / p), for exchanges that keep whole rows."""
        del mod, row
        return k, v, None

    def self_attention(
        self,
        mod,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        heads: int,
        spec: AttentionSpec,
        row: int | None = None,
    ) -> jax.Array:
        """Self-attention of the local queries: q, k, v (B, h*W, H*D) -> (B, h*W, H*D), `row`
        = W tokens per image row. This default attends to the keys/values `self_attn_kv`
        gives, with `spec`'s kernel."""
        k, v, mask = self.self_attn_kv(mod, k, v, row)  # (B, T_keys, H*D)
        return attend(spec, q, k, v, heads, mask)

    def joint_attention(
        self,
        mod,
        q: jax.Array,
        text_k: jax.Array,
        text_v: jax.Array,
        k: jax.Array,
        v: jax.Array,
        heads: int,
        spec: AttentionSpec,
        row: int | None = None,
    ) -> jax.Array:
        """An MMDiT's joint attention: the queries q (B, S + h*W, H*D) of the text tokens (the
        first S, every device holds all of them) and of the local image tokens attend over the
        text keys/values (B, S, H*D), which stay local, and the image keys/values k, v
        (B, h*W, H*D), whose whole image this site gives (`self_attn_kv`) -> (B, S + h*W, H*D)."""
        k, v, mask = self.self_attn_kv(mod, k, v, row)
        return attend_joint(spec, q, text_k, text_v, k, v, heads, mask)

    def text_stream(self, mod, txt: jax.Array) -> jax.Array:
        """An MMDiT's text tokens (B, S, D) after a block -> the copy this device keeps (every
        device computes the whole text stream; `parallel.sites.text`). Here: as they are."""
        del mod
        return txt

    def positions(self, mod, table, rows: int, cols: int) -> jax.Array:
        """A DiT's position embeddings of the local tokens, (rows x cols, D): `table(r, c)`
        gives the (r x c, D) table of an r x c token grid (a NumPy constant). Here the grid is
        the whole image; the parallel layer builds the whole image's table and takes the
        device's rows of it."""
        del mod
        return jnp.asarray(table(rows, cols))

    def model_degree(self) -> int:
        """Devices a tensor-parallel layer's weights are split over (1: none). Layers split
        heads, feed-forward and ResNet middle widths by it (Megatron, as the released
        DistriFusion's tensor-parallel baseline) and sum row-split outputs with `model_sum`."""
        return 1

    def model_sum(self, mod, y: jax.Array) -> jax.Array:
        """The sum over the model axis of a row-split layer's partial outputs (before its bias)."""
        del mod
        return y

    def layer(self, cls: type) -> type:
        """The class to build one layer (a ResNet block, a transformer block, a projection) from:
        `cls` itself here. FSDP returns a wrapper that gathers the layer's weights, sharded at
        rest, over the mesh when the layer runs (`patchpar.parallel.sites.PatchOps.layer`)."""
        return cls

    def repeated(self, n: int):
        """A context: the site calls traced inside it run `n` times (a scanned stack of
        blocks, `patchpar.models.scan`); the parallel layer's byte models count them so."""
        del n
        return contextlib.nullcontext()

    def one_trace(self):
        """A context around one trace of a `repeated` body."""
        return contextlib.nullcontext()

    def input_layer(self) -> SiteOps:
        """The ops of the model's first convolution, which reads the sampler's latent: its halo
        must be exact every step (the released DistriFusion slices its input from the full
        latent), whatever the strategy does elsewhere."""
        return self

    def with_stand_ins(self) -> SiteOps:
        """The same ops with every collective replaced by a local stand-in of the same shape
        (each device's compute alone); the identity has none."""
        return self


IDENTITY = SiteOps()
