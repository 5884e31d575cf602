"""PipeFusion's sites (docs/design.md §3b): a stage's self-attention over its full-image K/V
buffer, and the hops that carry activations from stage to stage.

`PipeKV` is the `SiteOps` of the blocks a stage runs on one of `patches` row patches. Each
self-attention layer keeps the whole image's keys and values (buffers `k`, `v`, (B, T, D), in
the `stale` collection); the patch being computed writes its own fresh keys/values into its slot
first, then its queries attend over the whole buffer: the slots of the patches this stage has
already computed in this step are fresh, the later ones are as at the previous step. The patch
index comes in the Flax collection `slot` (`at`, a traced int32) of the module, since it changes
from slot to slot of the compiled step, with `live` (a traced bool, optional): false where the
stage has no item in this slot, so that the buffer keeps what it held. With `patches = 1` (a full-image pass) the buffer is
the layer's own keys/values and the attention is exact. `positions` gives the patch's rows of
the whole image's position table, as `PatchOps` does for a device's slab.

Uneven patches (`rows`: each patch's token rows, where the patches' rows differ): every
patch is computed padded to the largest's rows; its slot starts where the patches above it
end, and only its own rows' keys/values are written there (the buffer has the padding's rows
as a tail, never attended to). The whole image's pass is one patch of all rows.

`Hop` passes an array over the patch (stage) axis by one collective-permute along the given
(source, target) pairs, in the `pp_pipe` scope; its byte model is that permute's (`pad`: the
share of it that is uneven patches' padding, counted apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from patchpar.models.sites import SiteOps
from patchpar.parallel.mesh import PATCH
from patchpar.parallel.sites.common import STALE, Site, nbytes, note, stand_in

SLOT = "slot"  # Flax collection: `at`, the index of the row patch being computed


@dataclass(frozen=True)
class PipeKV(SiteOps):
    """Self-attention over a full-image K/V buffer per layer, the computed patch fresh."""

    patches: int = 1
    rows: tuple[int, ...] | None = None  # uneven patches: each one's token rows

    def _at(self, mod) -> jax.Array:
        at = mod.get_variable(SLOT, "at")
        if at is None:
            raise ValueError(
                f"{mod.name or type(mod).__name__}: no patch index in collection {SLOT!r}"
            )
        return at

    def self_attn_kv(self, mod, k: jax.Array, v: jax.Array, row: int | None = None):
        """The patch's fresh (B, T/M, D) keys/values written into its slot of the layer's
        whole-image buffers (B, T, D), which the queries then attend to (the default
        `self_attention`). Uneven patches: (B, t, D) of the largest patch's t tokens, of which
        the patch's own are written where its rows start; the buffers (B, T + tail, D), of
        which the image's T are attended to."""
        del row  # patches are whole image rows
        b, tokens, d = k.shape
        whole = (b, tokens * self.patches, d)
        at = self._at(mod) * tokens
        keep = mod.get_variable(SLOT, "live")  # False: nothing of this call is kept
        if self.rows is not None:  # uneven: its own rows' tokens, where its slot starts
            cols = tokens // max(self.rows)
            at = self._start(mod) * cols
            own = jnp.arange(tokens) < jnp.asarray(self.rows, jnp.int32)[self._at(mod)] * cols
            keep = own[None, :, None] if keep is None else jnp.logical_and(keep, own)[None, :, None]
        for name, fresh in (("k", k), ("v", v)):
            buf = mod.variable(STALE, name, jnp.zeros, whole, fresh.dtype)
            if keep is not None:
                old = lax.dynamic_slice_in_dim(buf.value, at, tokens, axis=1)
                fresh = jnp.where(keep, fresh, old)
            buf.value = lax.dynamic_update_slice_in_dim(buf.value, fresh, at, axis=1)
        k, v = mod.get_variable(STALE, "k"), mod.get_variable(STALE, "v")
        if self.rows is not None:  # the image's keys alone (the tail: padding's rows)
            k, v = (a[:, : sum(self.rows) * cols] for a in (k, v))
        return k, v, None

    def _start(self, mod) -> jax.Array:
        """Uneven patches: the token row where the computed patch's slot starts."""
        starts = np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int32)
        return jnp.asarray(starts)[self._at(mod)]

    def positions(self, mod, table, rows: int, cols: int) -> jax.Array:
        if self.rows is not None:  # uneven: its own rows' positions, then the next rows'
            # (the last patch's padding: zeros), never read: the padding tokens are dropped
            whole = jnp.pad(jnp.asarray(table(sum(self.rows), cols)), ((0, rows * cols), (0, 0)))
            return lax.dynamic_slice_in_dim(whole, self._start(mod) * cols, rows * cols, axis=0)
        whole = jnp.asarray(table(rows * self.patches, cols))
        return lax.dynamic_slice_in_dim(whole, self._at(mod) * rows * cols, rows * cols, axis=0)


@dataclass(frozen=True)
class Hop(Site):
    """An array passed between stages over `patch`; `local`: a stand-in (each device keeps its
    own, `Plan(comm=False)`)."""

    kind: ClassVar[str] = "pipe"

    def send(self, x, pairs: tuple[tuple[int, int], ...], pad=None):
        """Device `dst` of each (src, dst) pair receives device `src`'s `x` (an array or a
        tuple of them: an MMDiT's image and text tokens, one permute each); the others
        zeros. `pad`: (padding, all) of the (first) array's rows over the patches it carries,
        uneven patches (None: no padding)."""
        if not pairs:
            return x
        if self.local:
            return stand_in(x)
        if isinstance(x, tuple):
            return tuple(self.send(a, pairs, pad if i == 0 else None) for i, a in enumerate(x))
        note(self, shape=x.shape, itemsize=x.dtype.itemsize, pairs=tuple(pairs), pad=pad)
        with jax.named_scope(f"pp_{self.kind}"):
            return lax.ppermute(x, PATCH, perm=list(pairs))

    def received_bytes(self, info: dict, p: int) -> int:
        return nbytes(info) * sum(1 for _, dst in info["pairs"] if dst == p)

    def padding_bytes(self, info: dict, p: int) -> int:
        """A slot carries one (traced) patch; over a step's slots every patch passes once, so
        the padding is that share of the bytes (each slot's rounded down: a step's total may
        be short by a byte per slot)."""
        if info.get("pad") is None:
            return 0
        padding, rows = info["pad"]
        return self.received_bytes(info, p) * padding // rows


@dataclass(frozen=True)
class Relay(Hop):
    """AsyncDiff's hops (`patchpar.parallel.asyncdiff`): each component's output to the
    device of the next, the last one's prediction to the first. patchpar sends each to the
    one device that reads it; the released code broadcasts every component's output, and the
    prediction, from its device to every device (`released_bytes`: at the component
    boundaries; the released code broadcasts each module of its split, more, so this is a lower
    bound); `released=False`: a second send of an array the released code broadcasts once
    (counted with the first)."""

    released: bool = True

    def released_bytes(self, info: dict, p: int) -> int:
        if not self.released:
            return 0
        return nbytes(info) * sum(1 for src, _ in info["pairs"] if src != p)
