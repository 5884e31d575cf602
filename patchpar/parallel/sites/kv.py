"""Site 3, self-attention keys/values: local queries attend to keys/values of other patches
(docs/design.md §2). Keys and values travel as one (2, B, L, D) payload.

Modes: `all` (every patch's fresh K/V, all-gathered every step), `local` (own only), `stale`
(own fresh + every other patch's as at step t-1: DistriFusion; buffer `kv`, (2, B, n*L, D),
or on a patch axis of 2 the other patch's alone, (2, B, L, D)),
`band` (own fresh + the last `portion` of the patch above and the first `portion` of the patch
below, as at step t-1: PCPP; buffers `kv_above`, `kv_below`, (2, B, band, D) each (in the heads
layout (2, B, H, band, D), as `stale`'s are (n, 2, B, H, L, D)); on a patch axis of 2 each patch
keeps and attends to its one neighbour's band alone, `kv_band`, where the missing band would be
memory and masked keys costing compute: L + 2 x band keys for L + band, 1.5x at portion 1).
During warm-up `stale` and `band` gather exactly and write their buffers. `send=full` sends the whole
neighbour K/V and crops at the receiver (PCPP's code); `send=band` only the rows used. The band
is `portion` of the patch's tokens (`align=tokens`, PCPP's code) or of its image rows, rounded
up to whole rows (`align=rows`: the model passes `row`, its tokens per image row; a whole-row
band is what a 2-D neighbour of a token actually is).
`exchange=False` is DistriFusion's no_sync (buffers stay as at the last warm-up step).
Uneven patches (`rows`): every slab is padded to the largest patch's tokens; the keys of
padding are masked, or where the patches are gathered taken out (which slot holds which patch
is known: static), so each query attends to the image's keys alone. A slab of its patch's own
tokens alone (`Rows.own_slab`) is padded here, for the buffers and sends, and its queries
stay its own.

Layout: where the split is even and nothing codes the wire (`in_heads`), K/V are formatted
once, by the device that computed them, into the kernels' heads-major layout
(`attention.Keys`: (2, B, H, L, D)), and travel, are kept and are read so: the stale buffer is
what the exchange delivered ((n, 2, B, H, L, D) on more than 2 devices, the own slot skipped
where it is read), and the own fresh K/V and the buffers attend as sources of one softmax
(`attention.attend_keys`), none copied into a whole-image buffer. Uneven splits and codecs keep
K/V in tokens ((2, B, L, D): padding taken out, codes per token) and join them into one
sequence before the kernel, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from patchpar.models.attention import AttentionSpec, Keys, attend_keys, heads_kv
from patchpar.parallel.mesh import PATCH
from patchpar.parallel.sites.common import STALE, PatchSite, exchange, nbytes, note

MODES = ("all", "local", "stale", "band")
SENDS = ("full", "band")
ALIGNS = ("tokens", "rows")


def band_tokens(tokens: int, portion: float, row: int | None = None) -> int:
    """Tokens of a neighbour's patch kept on each side: ceil(portion x tokens), at least one
    (PCPP's code rounds the band above up and the band below down; they differ by <= 1 token).
    With `row` (tokens per image row): ceil(portion x rows) whole rows, at least one."""
    if row:
        return row * band_tokens(tokens // row, portion)
    return max(1, min(tokens, math.ceil(portion * tokens - 1e-9)))


def _whole(gathered: jax.Array) -> jax.Array:
    """(n, 2, B, L, D) gathered patches -> (2, B, n*L, D), patches in order."""
    n, two, b, length, d = gathered.shape
    return jnp.moveaxis(gathered, 0, 2).reshape(two, b, n * length, d)


def _pair(own: jax.Array, other: jax.Array) -> jax.Array:
    """On a patch axis of 2: (2, B, L, D) own and other -> (2, B, 2L, D), patches in order
    (one fused copy, where a gather would lay out (2, ...) and transpose it)."""
    first = lax.axis_index(PATCH) == 0
    return jnp.where(first, jnp.concatenate([own, other], 2), jnp.concatenate([other, own], 2))


@dataclass(frozen=True)
class KV(PatchSite):
    kind = "kv"
    buffers = ("kv", "kv_above", "kv_below", "kv_band")
    mode: str = "all"
    portion: float = 1.0  # band: share of each neighbour patch's tokens kept
    sends: str = "full"  # band: send whole K/V and crop at the receiver, or only the band
    align: str = "tokens"  # band: portion of the patch's tokens, or of its rows (whole rows)
    exchange: bool = True  # steady phase: refresh the buffers (False: DistriFusion's no_sync)

    def __post_init__(self):
        super().__post_init__()
        for name, value, known in (
            ("kv", self.mode, MODES),
            ("send", self.sends, SENDS),
            ("align", self.align, ALIGNS),
        ):
            if value not in known:
                raise ValueError(f"{name}={value!r}; known: {list(known)}")

    def __call__(self, mod, q, k, v, heads: int, spec: AttentionSpec, row=None) -> jax.Array:
        """Self-attention of the local queries (B, L, H*D) over the keys/values the mode gives."""
        return attend_keys(spec, q, heads, self.sources(mod, k, v, heads, row))

    def joint(self, mod, q, text_k, text_v, k, v, heads: int, spec: AttentionSpec, row=None):
        """An MMDiT's joint attention: the image keys/values as `sources` gives them, the text's
        (local on every device) in front (`SiteOps.joint_attention`)."""
        text = Keys.of(text_k, text_v, heads)
        return attend_keys(spec, q, heads, [text, *self.sources(mod, k, v, heads, row)])

    @property
    def in_heads(self) -> bool:
        """Whether K/V travel and are kept in the kernels' heads layout (module docstring): an
        even split with nothing coded on the wire."""
        return self.split is None and self.link is None and self.wire is None

    def sources(self, mod, k: jax.Array, v: jax.Array, heads: int, row=None) -> list[Keys]:
        """Local (B, L, H*D) keys/values -> the sources (`attention.Keys`) the local queries
        attend to, in one softmax. `row`: tokens per image row (`align=rows`)."""
        if not self.in_heads:
            k, v, mask = self.keys(mod, k, v, row)
            return [Keys.of(k, v, heads, mask)]
        row = self._row(k.shape[1], row)
        note(self, shape=(2,) + k.shape, itemsize=k.dtype.itemsize, row=row)
        kv = heads_kv(k, v, heads)  # (2, B, H, L, D): formatted once, sent as it is
        own = Keys(kv[None])
        if self.mode == "local" or self.n == 1:
            return [own]
        if self.warmup or self.mode == "all":
            got = exchange(self.kind, [self._others(kv)], self.n, self.local)[0]
            if self.mode == "stale":
                mod.put_variable(STALE, "kv", self.receive(got)["kv"])
            elif self.mode == "band":
                self._keep_bands(mod, *self._bands_exact(kv, got, row))
            if self.n == 2:  # the own slot, then the other's
                return [own, Keys(got["other"][None])]
            return [Keys(got["gather"])]  # every patch in order, the own slot exact
        if self.mode == "stale":
            return self._stale_heads(mod, kv, own)
        return self._band_heads(mod, kv, own, row)

    def _index(self) -> jax.Array | int:
        """This device's patch index (0 for a stand-in: one device's program alone)."""
        return 0 if self.local else lax.axis_index(PATCH)

    def _stale_heads(self, mod, kv, own: Keys) -> list[Keys]:
        """DistriFusion's steady step: the own fresh K/V and every other patch's as at t-1,
        read from the buffer the last exchange delivered, the own stale slot skipped."""
        n = self.n
        shape = ((2,) if n == 2 else (n, 2)) + kv.shape[1:]  # n = 2: the other patch's alone
        buf = mod.variable(STALE, "kv", jnp.zeros, shape, kv.dtype)
        stale = Keys(buf.value[None]) if n == 2 else Keys(buf.value, skip=self._index())
        if self.exchange:
            self.send(mod, self._others(kv))
        return [own, stale]

    def _band_heads(self, mod, kv, own: Keys, row) -> list[Keys]:
        """PCPP's steady step: the band above (stale), the own fresh K/V, the band below; on a
        patch axis of 2 the own K/V and the one neighbour's band (`kv_band`)."""
        band = self._band(kv.shape[3], row)
        shape = kv.shape[:3] + (band,) + kv.shape[4:]
        if self.n == 2:  # one neighbour each: its band alone, nothing masked
            other = mod.variable(STALE, "kv_band", jnp.zeros, shape, kv.dtype)
            sources = [own, Keys(other.value[None])]
        else:  # no band above device 0 or below the last
            idx = self._index()
            above = mod.variable(STALE, "kv_above", jnp.zeros, shape, kv.dtype)
            below = mod.variable(STALE, "kv_below", jnp.zeros, shape, kv.dtype)
            has = lambda exists: jnp.broadcast_to(exists, (1, 1, band))  # noqa: E731
            sources = [
                Keys(above.value[None], has(idx > 0)),
                own,
                Keys(below.value[None], has(idx < self.n - 1)),
            ]
        if self.exchange:  # after the reads: an unpacked send refreshes the buffers at once
            self.send(mod, self._band_sends(kv, band, row))
        return sources

    def _bands_exact(self, kv, got, row) -> tuple[jax.Array, jax.Array]:
        """Heads layout: the neighbours' bands out of an exact exchange (zeros where there is
        no neighbour): the last `band` tokens of the patch above, the first of the patch below."""
        n, length = self.n, kv.shape[3]
        band = self._band(length, row)
        idx = self._index()
        if n == 2:
            other = got["other"]
            above, below = other[:, :, :, length - band :], other[:, :, :, :band]
        else:
            gathered = got["gather"]  # (n, 2, B, H, L, D)
            size = (1,) + kv.shape[:3] + (band, kv.shape[4])
            at = lambda i, t: (i, 0, 0, 0, t, 0)  # noqa: E731
            above = lax.dynamic_slice(gathered, at(jnp.maximum(idx - 1, 0), length - band), size)[0]
            below = lax.dynamic_slice(gathered, at(jnp.minimum(idx + 1, n - 1), 0), size)[0]
        above = jnp.where(idx > 0, above, jnp.zeros_like(above))
        below = jnp.where(idx < n - 1, below, jnp.zeros_like(below))
        return above, below

    def keys(self, mod, k: jax.Array, v: jax.Array, row: int | None = None):
        """Local (B, L, D) keys/values -> (B, T, D) keys/values to attend to, and a (T,) mask of
        the keys that exist (None: all). `row`: tokens per image row (`align=rows`)."""
        split = self.split
        if split is not None and split.own_slab:  # own tokens alone: padded for the exchange
            pad = ((0, 0), (0, split.padded(k.shape[1]) - k.shape[1]), (0, 0))
            return replace(self, slab=None).keys(mod, jnp.pad(k, pad), jnp.pad(v, pad), row)
        row = self._row(k.shape[1], row)
        note(self, shape=(2,) + k.shape, itemsize=k.dtype.itemsize, row=row)
        if self.mode == "local" or self.n == 1:
            return k, v, None if self.split is None else self.split.own_mask(k.shape[1])
        kv = jnp.stack([k, v])  # (2, B, L, D): one payload for both
        if self.split is not None and self.link is not None:  # a codec codes no padding
            own = self.split.own_mask(kv.shape[2])[None, None, :, None]
            kv = jnp.where(own, kv, jnp.zeros_like(kv))
        if self.warmup or self.mode == "all":
            sends = self._others(kv)
            if self.mode == "band":  # its link starts from the bands, cut below
                got = exchange(self.kind, [sends], self.n, self.local)[0]
            else:  # exact in warm-up (a link's bases start there), compressed after with one
                got = self.exchange_now(mod, sends)
            full = self._full(kv, got)  # (2, B, n*L, D)
            if self.mode == "stale":
                mod.put_variable(STALE, "kv", self.receive(got)["kv"])
            elif self.mode == "band":
                self._keep_bands(mod, *self._bands_from_full(full, kv.shape[2], row))
                if self.link is not None:
                    self._start_band(mod, kv, full, row)
            return self._image_keys(full, kv.shape[2])
        if self.mode == "stale":
            return self._stale_all(mod, kv)
        return self._stale_band(mod, kv, row)

    def _image_keys(self, full: jax.Array, length: int):
        """(2, B, n*L, D) patches' K/V in order -> keys, values and mask: uneven patches' keys
        without their padding (which slots are padding is static: taken out, not masked, so
        that no query pays for them)."""
        if self.split is None:
            return full[0], full[1], None
        keep = np.flatnonzero(self.split.gathered_mask(length))
        full = jnp.take(full, jnp.asarray(keep, jnp.int32), axis=2)
        return full[0], full[1], None

    def _row(self, length: int, row: int | None) -> int | None:
        """Tokens per row the band keeps whole (None: tokens, as PCPP's code)."""
        if self.mode != "band" or self.align == "tokens":
            return None
        if not row or length % row:
            raise ValueError(
                f"pcpp align=rows: this self-attention's {length} tokens do not come as whole "
                f"image rows (row={row}); the model must pass its tokens per row, or use "
                f"align=tokens"
            )
        return row

    def _others(self, kv) -> dict:
        """What a device sends for the K/V of the other patches."""
        return {"other": kv} if self.n == 2 else {"gather": kv}

    def _full(self, kv, got) -> jax.Array:
        """(2, B, n*L, D): own fresh K/V with the others' received (a compressed exchange's
        own slot is its base: the fresh K/V goes in its place)."""
        if self.n == 2:
            return _pair(kv, got["other"])
        full = _whole(got["gather"])
        if (self.link is None or self.warmup) and self.wire is None:
            return full  # own slot: its own K/V, exact (a codec's: decoded, so replaced)
        idx = lax.axis_index(PATCH)
        return lax.dynamic_update_slice_in_dim(full, kv, idx * kv.shape[2], axis=2)

    def _stale_all(self, mod, kv):
        n, length = self.n, kv.shape[2]
        shape = kv.shape[:2] + ((n if n > 2 else 1) * length,) + kv.shape[3:]
        buf = mod.variable(STALE, "kv", jnp.zeros, shape, kv.dtype)
        if n == 2:  # the buffer holds the other patch alone
            full = _pair(kv, buf.value)
        else:  # own slot fresh
            idx = lax.axis_index(PATCH)
            full = lax.dynamic_update_slice_in_dim(buf.value, kv, idx * length, axis=2)
        if self.exchange:
            self.send(mod, self._others(kv))
        return self._image_keys(full, length)

    def _band(self, length: int, row: int | None) -> int:
        """Tokens of a neighbour's band: `portion` of a patch's tokens (uneven patches: of the
        smallest patch's, so that every band is of one static size and all image)."""
        if self.split is not None:
            length = min(self.split.counts(length))
        return band_tokens(length, self.portion, row)

    def _neighbour(self, step: int) -> jax.Array:
        """The patch index `step` away from this device's (clipped to the axis)."""
        idx = 0 if self.local else lax.axis_index(PATCH)
        return jnp.clip(idx + step, 0, self.n - 1)

    def _stale_band(self, mod, kv, row):
        length = kv.shape[2]
        band = self._band(length, row)
        shape = kv.shape[:2] + (band,) + kv.shape[3:]
        own = None if self.split is None else self.split.own_mask(length)  # else all
        if self.n == 2:  # one neighbour each: its band alone beside the own K/V, nothing masked
            first = lax.axis_index(PATCH) == 0
            other = mod.variable(STALE, "kv_band", jnp.zeros, shape, kv.dtype)
            keys = _pair(kv, other.value)  # (2, B, L+band, D)
            mask = None
            if own is not None:  # but the own padding
                ones = jnp.ones((band,), bool)
                mask = jnp.where(first, jnp.concatenate([own, ones]), jnp.concatenate([ones, own]))
        else:
            above = mod.variable(STALE, "kv_above", jnp.zeros, shape, kv.dtype)
            below = mod.variable(STALE, "kv_below", jnp.zeros, shape, kv.dtype)
            keys = jnp.concatenate([above.value, kv, below.value], axis=2)  # (2, B, L+2band, D)
            mask = self._band_mask(band, length, own)
        if self.exchange:  # after the reads: an unpacked send refreshes the buffers at once
            self.send(mod, self._band_sends(kv, band, row))
        return keys[0], keys[1], mask

    def _band_sends(self, kv, band: int, row, end=None) -> dict:
        """What a device sends its neighbours for their bands: down to the patch below, up to
        the patch above (`end`: uneven patches, the own tokens of the patch whose `kv` this is;
        None: this device's)."""
        ax = self._tokens_axis()
        if self.sends == "full":  # PCPP's code: whole neighbour K/V, cropped at the receiver
            # whole rows travel as (..., rows, row, D): the receiver crops rows
            whole = kv if row is None else kv.reshape(kv.shape[:ax] + (-1, row, kv.shape[-1]))
            return {"down": whole, "up": whole}
        length = kv.shape[ax]  # only the rows used
        up = lax.slice_in_dim(kv, 0, band, axis=ax)
        if self.split is None:
            return {"down": lax.slice_in_dim(kv, length - band, length, axis=ax), "up": up}
        end = self.split.mine(length) if end is None else end  # uneven: its last own token
        return {"down": lax.dynamic_slice_in_dim(kv, end - band, band, ax), "up": up}

    def _tokens_axis(self) -> int:
        """The tokens' axis of a payload: (2, B, H, L, D) in heads layout, (2, B, L, D) else."""
        return 3 if self.in_heads else 2

    def _start_band(self, mod, kv, full, row) -> None:
        """The link's bases after the exact warm-up: what the band sends of this patch and of
        its neighbours (out of the all-gather; zeros where there is no neighbour) would be."""
        length, n = kv.shape[2], self.n
        band = self._band(length, row)
        idx = lax.axis_index(PATCH)

        def patch(i, present):
            got = lax.dynamic_slice_in_dim(full, jnp.clip(i, 0, n - 1) * length, length, axis=2)
            return jnp.where(present, got, jnp.zeros_like(got))

        above = None  # uneven: the patch above's own tokens end before its padding
        if self.split is not None:
            above = jnp.asarray(self.split.counts(length), jnp.int32)[self._neighbour(-1)]
        got = {
            "down": self._band_sends(patch(idx - 1, idx > 0), band, row, above)["down"],
            "up": self._band_sends(patch(idx + 1, idx < n - 1), band, row)["up"],
        }
        self.link.start(mod, self.kind, self._band_sends(kv, band, row), got)

    def receive(self, got):
        if self.mode == "stale":
            if self.n == 2:
                return {"kv": got["other"]}
            return {"kv": got["gather"] if self.in_heads else _whole(got["gather"])}
        # from the patches above, below: (..., L or band, D), or (..., rows, row, D) whole rows
        down, up = got["down"], got["up"]
        if self.split is not None:
            return self._receive_uneven(down, up)
        ax = self._tokens_axis()
        size = down.shape[ax]
        band = band_tokens(size, self.portion) if self.sends == "full" else size
        above = lax.slice_in_dim(down, size - band, size, axis=ax)
        below = lax.slice_in_dim(up, 0, band, axis=ax)
        if above.ndim == ax + 3:  # whole rows, cropped by rows
            merge = lambda a: a.reshape(a.shape[:ax] + (-1, a.shape[-1]))  # noqa: E731
            above, below = merge(above), merge(below)
        return self._bands(above, below)

    def _receive_uneven(self, down, up):
        """Uneven patches: the band above is the last of the above patch's own tokens (a whole
        K/V sent is cropped at its patch's count), the band below the first of the patch
        below."""
        if down.ndim == 5:  # whole rows: as tokens
            row = down.shape[3]
            down, up = (a.reshape(a.shape[:2] + (-1, a.shape[4])) for a in (down, up))
        else:
            row = None
        if self.sends == "band":
            return self._bands(down, up)
        length = down.shape[2]
        band = self._band(length, row)
        end = jnp.asarray(self.split.counts(length), jnp.int32)[self._neighbour(-1)]
        above = lax.dynamic_slice_in_dim(down, end - band, band, axis=2)
        return self._bands(above, up[:, :, :band])

    def _bands(self, above: jax.Array, below: jax.Array) -> dict[str, jax.Array]:
        """PCPP's buffers from the bands of the patches above and below: `kv_above` and
        `kv_below`; on a patch axis of 2, where each patch has one neighbour, that neighbour's
        band alone (`kv_band`: below for patch 0, above for patch 1), half the memory."""
        if self.n == 2:
            return {"kv_band": jnp.where(self._index() == 0, below, above)}
        return {"kv_above": above, "kv_below": below}

    def _keep_bands(self, mod, above: jax.Array, below: jax.Array) -> None:
        for name, value in self._bands(above, below).items():
            mod.put_variable(STALE, name, value)

    def _bands_from_full(self, full, length, row):
        """The neighbours' bands out of an exact all-gather (zeros where there is no neighbour)."""
        band = self._band(length, row)
        idx = lax.axis_index(PATCH)
        start_above = jnp.maximum(idx * length - band, 0)
        if self.split is not None:  # the above patch's own tokens end before its padding
            counts = jnp.asarray(self.split.counts(length), jnp.int32)
            start_above = jnp.maximum((idx - 1) * length + counts[self._neighbour(-1)] - band, 0)
        above = lax.dynamic_slice_in_dim(full, start_above, band, axis=2)
        below = lax.dynamic_slice_in_dim(
            full, jnp.minimum((idx + 1) * length, full.shape[2] - band), band, axis=2
        )
        above = jnp.where(idx > 0, above, jnp.zeros_like(above))
        below = jnp.where(idx < self.n - 1, below, jnp.zeros_like(below))
        return above, below

    def _band_mask(self, band: int, length: int, own=None) -> jax.Array:
        """(band + L + band,) keys that exist: no band above device 0 or below the last device
        (`own`: this patch's own tokens of its slab, uneven patches; None: all)."""
        idx = lax.axis_index(PATCH)
        has_above = jnp.broadcast_to(idx > 0, (band,))
        has_below = jnp.broadcast_to(idx < self.n - 1, (band,))
        own = jnp.ones((length,), bool) if own is None else own
        return jnp.concatenate([has_above, own, has_below])

    def sends_stale(self) -> bool:
        return self.mode in ("stale", "band") and self.exchange

    def _exchanged(self) -> bool:
        return self.mode != "local" and (self.warmup or self.mode == "all" or self.exchange)

    def received_bytes(self, info, p):
        n = self.n
        if n == 1 or not self._exchanged():
            return 0
        shape, itemsize = info["shape"], info["itemsize"]
        if self.warmup or self.mode in ("all", "stale"):
            return (n - 1) * self.wire_bytes(shape, itemsize)  # all-gather
        band = self._band(shape[2], info.get("row"))
        if self.sends == "band":
            shape = shape[:2] + (band,) + shape[3:]
        return self.wire_bytes(shape, itemsize) * ((p > 0) + (p < n - 1))

    def padding_bytes(self, info, p):
        """Uneven patches: of a gathered slab of L tokens, patch j's L - its own tokens."""
        if self.split is None or self.received_bytes(info, p) == 0:
            return 0
        length = info["shape"][2]
        per = self.wire_bytes(info["shape"], info["itemsize"])
        own = self.split.counts(length)
        if self.warmup or self.mode in ("all", "stale"):  # the other patches' slabs
            return sum(per * (length - own[j]) // length for j in range(self.n) if j != p)
        if self.sends == "band":  # the bands are the neighbours' own tokens
            return 0
        return sum(per * (length - own[j]) // length for j in (p - 1, p + 1) if 0 <= j < self.n)

    def released_bytes(self, info, p):
        """The released code all-gathers K/V (warm-up, DistriFusion); PCPP's steady phase sends
        the whole K/V to each neighbour (its code has no band-only send)."""
        n = self.n
        if n == 1 or not self._exchanged():
            return 0
        size = nbytes(info)
        if not self.warmup and self.mode == "band":
            return size * ((p > 0) + (p < n - 1))
        return (n - 1) * size
