"""How a latent's rows are split over the patch devices (docs/design.md §2b): evenly where they
divide, otherwise the most even split of whole row units (a unit: the denoiser's row multiple),
or in proportion to given weights (a faster device takes more rows).

Inside `shard_map` every device holds the same number of rows, the largest patch's (`pad`):
a patch of fewer rows holds its rows first and padding after. The split is static (Python
ints, known when the program is traced); which patch a device holds is `axis_index`, so a
device's own count is a lookup. The sites read it: a halo goes below the patch's last row, not
below its padding; GroupNorm counts its patch's rows only and weighs each patch by its rows;
attention masks the keys of padding rows; positions start at the patch's first global row.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from patchpar.parallel.mesh import PATCH


def split_rows(
    rows: int, n: int, multiple: int, weights: Sequence[float] | None = None, why: str = ""
) -> tuple[int, ...]:
    """The rows of each of `n` patches, in order, for `rows` latent rows in units of
    `multiple` rows: in proportion to `weights` (None: equal), each patch at least one unit,
    the units left over by rounding down given to the largest remainders (ties: the first
    patches). A ValueError names what cannot be split and what would fit. `why`: what the
    multiple is (for the message)."""
    because = f" ({why})" if why else ""
    if rows % multiple:
        raise ValueError(
            f"latent rows={rows} are not a multiple of {multiple}{because}: no patch split "
            f"gives whole units; use a size whose latent rows are a multiple of {multiple}"
        )
    units = rows // multiple
    if weights is None:
        weights = (1.0,) * n
    check_weights(weights, n)
    if units < n:
        raise ValueError(
            f"latent rows={rows} are {units} unit(s) of {multiple}{because}: fewer than the "
            f"{n} patch devices, each of which needs at least one; use at most {units} patch "
            f"devices or a latent of at least {n * multiple} rows"
        )
    total = sum(weights)
    share = [w * units / total for w in weights]
    for i, s in enumerate(share):
        if s < 1 - 1e-9:  # (a share of one unit in floating point may read 0.999...)
            rest = total - weights[i]
            least = math.ceil(1000 * rest / (units - 1)) / 1000 if units > 1 else math.inf
            raise ValueError(
                f"patch_weights={fmt(weights)} give patch device {i} {s * multiple:.2f} of the "
                f"{rows} latent rows, fewer than its minimum of {multiple}{because}: raise its "
                f"weight to at least {least:.3g}, or use a larger image"
            )
    got = [math.floor(s + 1e-9) for s in share]  # each >= 1 (checked above)
    order = sorted(range(n), key=lambda j: (-(share[j] - got[j]), j))
    for i in order[: units - sum(got)]:  # the units rounding left, to the largest remainders
        got[i] += 1
    return tuple(g * multiple for g in got)


UNEVEN_COMPUTE = ("auto", "own", "padded")  # `Plan.uneven_compute`


def describe(rows: int, got: Sequence[int], unet, weighted: bool) -> str:
    """One line saying how an uneven split `got` of `rows` latent rows falls (`unet`: its
    denoiser, for the row multiple and why)."""
    why = "in proportion to the patch weights"
    if not weighted:
        why = f"the most even split in units of {unet.row_multiple} rows, "
        why += unet.row_multiple_reason
    return (
        f"latent rows={rows} over {len(got)} patch devices: {', '.join(map(str, got))} rows "
        f"({why}); each slab is padded to {max(got)} rows for the exchanges"
    )


def floored(weights: Sequence[float], rows: int, multiple: int) -> tuple[float, ...]:
    """`weights` (measured speeds) with those whose share of the `rows` latent rows would be
    under one unit of `multiple` rows raised to exactly one unit's share (a device much slower
    than the others still takes one unit: `split_rows` needs it)."""
    units, w = rows // multiple, list(weights)
    low: set[int] = set()
    while units > len(low):
        total = sum(w)
        new = {i for i in range(len(w)) if i not in low and w[i] * units < total * (1 - 1e-9)}
        if not new:
            break
        low |= new
        rest = sum(x for i, x in enumerate(w) if i not in low)  # one unit each for the low
        for i in low:
            w[i] = rest / (units - len(low))
    return tuple(w)


def check_weights(weights: Sequence[float], n: int) -> None:
    """Patch weights: one positive finite number per patch device."""
    if len(weights) != n:
        raise ValueError(
            f"patch_weights={fmt(weights)}: {len(weights)} weight(s) for {n} patch devices; "
            f"give one per patch device, in order"
        )
    bad = [w for w in weights if isinstance(w, bool) or not (
        isinstance(w, numbers.Real) and math.isfinite(w) and w > 0)]  # fmt: skip
    if bad:
        raise ValueError(
            f"patch_weights={fmt(weights)}: {bad[0]!r} is not a positive number; every "
            f"weight must be > 0 (a device's share of the rows)"
        )


def fmt(weights: Sequence[float]) -> str:
    return ",".join(f"{w:g}" if isinstance(w, int | float) else repr(w) for w in weights)


def is_even(rows: Sequence[int] | None) -> bool:
    """Whether a split is today's even one (no padding anywhere)."""
    return rows is None or len(set(rows)) <= 1


class Rows:
    """A split's per-device figures at a site whose local slab has `h` rows (or tokens) where
    the latent slab has `slab` rows (the largest patch's, `pad`, by default: a padded slab):
    the patches' counts scale with the slab (a UNet level's rows, a DiT's tokens). A slab of
    one patch's own rows alone (`slab` = its rows: `own_slab`, compute in proportion to them)
    sends and keeps its buffers in the padded layout (`padded`). `local`: a stand-in program
    (one device's compute alone): patch 0's."""

    def __init__(self, rows: Sequence[int], local: bool = False, slab: int | None = None):
        self.rows = tuple(rows)
        self.pad = max(self.rows)
        self.local = local
        self.slab = self.pad if slab is None else slab

    @property
    def own_slab(self) -> bool:
        """Whether the local slab holds its patch's rows alone (no padding)."""
        return self.slab != self.pad

    def counts(self, h: int) -> tuple[int, ...]:
        """Each patch's own rows (or tokens) at the scale of a slab of `h` (static)."""
        return tuple(r * h // self.slab for r in self.rows)

    def padded(self, h: int) -> int:
        """The padded slab's rows (or tokens) at the scale of a slab of `h`: what every device
        sends and keeps for its patch."""
        return self.pad * h // self.slab

    def mine(self, h: int) -> jax.Array:
        """This device's own count of a slab of `h` (traced)."""
        if self.local:
            return jnp.asarray(self.counts(h)[0], jnp.int32)
        return jnp.asarray(self.counts(h), jnp.int32)[lax.axis_index(PATCH)]

    def start(self, h: int) -> jax.Array:
        """This device's first global row (or token) of a slab of `h` (traced)."""
        starts = np.concatenate([[0], np.cumsum(self.counts(h))[:-1]]).astype(np.int32)
        if self.local:
            return jnp.asarray(0, jnp.int32)
        return jnp.asarray(starts)[lax.axis_index(PATCH)]

    def weight(self) -> jax.Array:
        """This device's rows over the mean patch's: what makes a mean over the patch axis a
        mean over the image's rows (traced)."""
        w = np.asarray(self.rows, np.float32) * len(self.rows) / sum(self.rows)
        return jnp.asarray(w[0] if self.local else jnp.asarray(w)[lax.axis_index(PATCH)])

    def own_mask(self, h: int) -> jax.Array:
        """(h,) bool: this device's rows (or tokens) of its slab that are its patch's."""
        return jnp.arange(h) < self.mine(h)

    def gathered_mask(self, h: int) -> np.ndarray:
        """(n * h,) bool of the slabs gathered in patch order: which are patches' rows (static)."""
        return np.concatenate([np.arange(h) < c for c in self.counts(h)])


def pad_rows(x: jax.Array, rows: Sequence[int], axis: int = 1) -> jax.Array:
    """(..., sum(rows), ...) -> (..., n * max(rows), ...): each patch's rows followed by zeros up
    to the largest patch's."""
    pad, at, parts = max(rows), 0, []
    for r in rows:
        part = lax.slice_in_dim(x, at, at + r, axis=axis)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad - r)
        parts.append(jnp.pad(part, widths))
        at += r
    return jnp.concatenate(parts, axis=axis)


def unpad_rows(x: jax.Array, rows: Sequence[int], axis: int = 1) -> jax.Array:
    """The inverse of `pad_rows`: each patch's own rows, joined."""
    pad = max(rows)
    parts = [lax.slice_in_dim(x, i * pad, i * pad + r, axis=axis) for i, r in enumerate(rows)]
    return jnp.concatenate(parts, axis=axis)


def guided_slab(plan, latent_shape: tuple[int, ...], unet) -> tuple[int, ...]:
    """One device's share of one step's guided output, (B, H, W, C) -> its slab (the unit of
    the cfg gather's bytes): its images, and its rows (or columns) of the patch axis (uneven
    patches: the largest patch's, as every slab is padded to it); a program that does not
    split the rows (PipeFusion's) guides every row each step."""
    b, h, w, c = latent_shape
    axis = plan.strategy.patch_axis(0)
    n = plan.patch if plan.program.splits_rows else 1
    rows = plan.patch_rows(h, unet)  # uneven: the largest patch's, as the slabs are padded
    rows = max(rows) if rows else (h // n if axis == "row" else h)
    return (b // plan.data, rows, w // n if axis == "col" else w, c)
