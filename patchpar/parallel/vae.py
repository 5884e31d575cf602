"""The VAE on several devices (docs/design.md §2c): patch-parallel rows (exact) or distributed
tiles (diffusers' tiling rule, not exact).

- `rows`: the decoder (or encoder) runs under `shard_map` with the latent (image) split into
  row patches over `devices / data` devices and the images over `data`. It is built of the
  three sites the denoiser uses, all exact here: every 3x3 convolution takes its halo from the
  neighbours (after each nearest upsampling too, so the rows it reads are the neighbour's
  upsampled ones), GroupNorm all-reduces its statistics, and the mid-block self-attention is
  Ring attention over the patches (a device holds one block of K/V at a time, 1/n of a
  gather's). Rows the patches do not divide split as evenly as they go, every slab padded to
  the largest patch's (`latent_rows`; `parallel.split`). Decoded rows leave the program
  sharded; `to_local` gathers them once.
- `tiles`: diffusers' `enable_tiling` rule: latent tiles of `tile / f` rows and columns at a
  stride of 3/4 of that, each decoded alone (its own GroupNorm statistics and attention: not
  exact), spread over every device (one tile at a time per device), then blended over a quarter
  tile with linear weights, each tile cropped to 3/4 tile, in diffusers' order (a blended tile
  is what the next one blends with).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from patchpar.parallel.mesh import DATA, PATCH, divisors, make_mesh, mesh_shape
from patchpar.parallel.sites import patch_ops
from patchpar.parallel.split import pad_rows, split_rows, unpad_rows

MODES = ("off", "rows", "tiles")
TILE_OVERLAP = 0.25  # diffusers' tile_overlap_factor


@dataclass(frozen=True)
class VAEPlan:
    """How the VAE runs: `off` (one device, the whole image), `rows` (row patches, exact) or
    `tiles` (distributed tiles, blended); on `devices` = data x patch, images split over
    `data`. `tile`: a tile's side in pixels (0: the VAE's sample size, diffusers' default)."""

    mode: str = "off"
    devices: int = 1
    data: int = 1
    tile: int = 0

    @property
    def patch(self) -> int:
        return self.devices // self.data

    @property
    def whole(self) -> bool:
        """The plain one-device decode (off, or rows on one device)."""
        return self.mode == "off" or (self.mode == "rows" and self.devices == 1)

    @property
    def parallel(self) -> bool:
        """Whether the VAE runs over several devices (every process must then take part)."""
        return self.mode != "off" and self.devices > 1

    def tile_size(self, vae) -> int:
        return self.tile or vae.config.sample_size

    def validate(self, vae, latent_hw: tuple[int, int], batch: int | None = None) -> None:
        """ValueError naming the numbers and what would fit."""
        if self.mode not in MODES:
            raise ValueError(f"vae_parallel={self.mode!r}; known: {list(MODES)}")
        mesh_shape(self.devices, 1, self.data)
        if self.mode == "off":
            return
        if vae is None:
            raise ValueError(
                f"vae_parallel={self.mode!r}: this model has no VAE (it samples in pixel "
                "space); use vae_parallel=off"
            )
        f = vae.config.downsample_factor
        h, w = latent_hw
        if self.mode == "rows":
            if self.devices > 1 and self.patch == 1:
                raise ValueError(
                    f"vae_parallel=rows splits each image's rows over the devices of its data "
                    f"slice (devices / data), but devices={self.devices} / data={self.data} "
                    f"leaves 1: every data slice already decodes its own images whole; use "
                    f"data < devices (e.g. data=1: rows over all {self.devices} devices) or "
                    f"vae_parallel=off"
                )
            if h < self.patch:
                raise ValueError(
                    f"vae_parallel=rows: the latent's {h} rows are fewer than the {self.patch} "
                    f"row patches, each of which needs one; use at most {h} devices per image "
                    f"or an image of at least {self.patch * f} rows"
                )
            if batch is not None and batch % self.data:
                raise ValueError(
                    f"vae_parallel=rows: {batch} image(s) do not split over data={self.data}; "
                    f"use a multiple of {self.data} images or data in {divisors(batch)}"
                )
        else:
            t = self.tile_size(vae)
            if not isinstance(t, int) or t <= 0 or t % f or t // f < 2:
                raise ValueError(
                    f"vae_tile={t!r}: a tile's side must be a positive multiple of the VAE "
                    f"factor {f}, at least {2 * f} pixels"
                )
            if h * f <= t and w * f <= t:
                raise ValueError(
                    f"vae_tile={t} is not smaller than the {h * f}x{w * f} image: tiled decode "
                    f"would be one tile (the plain decode); use vae_tile < {max(h, w) * f} "
                    f"(a multiple of {f}) or vae_parallel=rows for an exact split"
                )


def latent_rows(h: int, n: int) -> tuple[int, ...] | None:
    """The latent rows of each of `n` row patches of an `h`-row latent: None where they divide
    evenly, else the most even split (`split.split_rows`; the upsampling chain keeps each
    patch's rows, so any row is a unit). Uneven patches run padded to the largest patch's
    rows, the sites reading each patch's own (docs/design.md, "Uneven patches")."""
    return None if h % n == 0 else split_rows(h, n, 1)


def _spec(h: int, n: int) -> P:
    """Where a (B, h, ...) input goes: its rows over the patch devices where they divide, else
    whole on each (the program pads it into uneven patches)."""
    return P(DATA, PATCH) if h % n == 0 else P(DATA)


def decode(vae, params, z: jax.Array, plan: VAEPlan) -> jax.Array:
    """Latent (B, h, w, C), already divided by the scaling factor, -> images (B, H, W, 3) in
    [-1, 1], as `plan` says. Validates first."""
    plan.validate(vae, z.shape[1:3], z.shape[0])
    if plan.whole:
        return _whole_decode(vae, params, z)
    if plan.mode == "rows":
        mesh = make_mesh(plan.devices, 1, plan.data)
        z = _global(z, mesh, _spec(z.shape[1], plan.patch))
        return _rows(vae, params, z, mesh, "decode")
    return tiled_decode(vae, params, z, plan.tile_size(vae), plan.devices)


def encode(vae, params, images: jax.Array, plan: VAEPlan) -> tuple[jax.Array, jax.Array]:
    """Images (B, H, W, 3) in [-1, 1] -> the latent distribution's (mean, logvar), each
    (B, H/f, W/f, C): rows only (image rows a multiple of patch x f)."""
    f = vae.config.downsample_factor
    if plan.mode not in ("off", "rows"):
        raise ValueError(f"encode: vae_parallel={plan.mode!r}; the encoder runs off or rows")
    if images.shape[1] % f:
        raise ValueError(f"encode: image height {images.shape[1]} is not a multiple of {f}")
    plan.validate(vae, (images.shape[1] // f, images.shape[2] // f), images.shape[0])
    if plan.mode == "off" or plan.devices == 1:
        return _whole_encode(vae, params, images)
    mesh = make_mesh(plan.devices, 1, plan.data)
    x = _global(images, mesh, _spec(images.shape[1] // f, plan.patch))
    return _rows(vae, params, x, mesh, "encode")


@partial(jax.jit, static_argnums=(0,))
def _whole_decode(vae, params, z):
    return vae(params, z)


@partial(jax.jit, static_argnums=(0,))
def _whole_encode(vae, params, images):
    return vae.encode(params, images)


def _global(x, mesh, spec) -> jax.Array:
    """`x` (the same whole value on every process) as a global array laid out by `spec`."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x  # already global (a sharded result of the denoising program)
    if jax.process_count() == 1:
        return jax.device_put(x, NamedSharding(mesh, spec))
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


@partial(jax.jit, static_argnums=(0, 3, 4))
def _rows(vae, params, x, mesh, method: str):
    """The decoder or encoder on row patches: x (B, H, W, C) sharded (data, patch) -> its
    output, sharded alike."""
    n, f = mesh.shape[PATCH], vae.config.downsample_factor
    ops = patch_ops(n, "warmup", ulysses=1)  # exact: fresh, sync, ring
    scale = 1 if method == "decode" else f  # input rows per latent row
    rows = latent_rows(x.shape[1] // scale, n)
    if rows is not None:  # uneven: every slab padded to the largest patch's rows
        ops = ops.with_rows(rows)
        x = pad_rows(x, [r * scale for r in rows])
    local = vae.with_ops(ops)
    call = local if method == "decode" else local.encode
    spec = P(DATA, PATCH)
    out_specs = spec if method == "decode" else (spec, spec)
    fn = jax.shard_map(
        lambda p, xs: call(p, xs),  # (b, H/n, W, C) per device
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), params), spec),
        out_specs=out_specs,
        check_vma=False,
    )
    out = fn(params, x)
    if rows is None:
        return out
    if method == "decode":  # each patch's own rows, joined
        return unpad_rows(out, [r * f for r in rows])
    return tuple(unpad_rows(o, rows) for o in out)


# ------------------------------------------------------------------------------ video


def decode_video(vae, params, z: jax.Array, plan: VAEPlan) -> jax.Array:
    """A video latent (B, F, h, w, C), un-normalised, -> frames (B, T, H, W, 3) in [-1, 1]: on
    one device (`off`) or on row patches of every frame (`rows`, exact: each causal 3-D
    convolution's halo from the neighbours, frame by frame, the per-frame attention over every
    patch's pixels; time stays causal, each device carrying its own rows' caches). A video
    VAE (`vae.decode(params, z)`, `vae.with_ops`) has no tiles here."""
    check_video_plan(plan, vae, z.shape[2:4], z.shape[0])
    if plan.whole:
        return _whole_video(vae, params, z)
    mesh = make_mesh(plan.devices, 1, plan.data)
    rows = latent_rows(z.shape[2], plan.patch)
    if rows is not None:  # uneven: every slab padded to the largest patch's rows
        z = pad_rows(jnp.asarray(z), rows, axis=2)
    out = _video_rows(vae, params, _global(z, mesh, VIDEO_SPEC), mesh, rows)
    f = vae.config.downsample_factor
    return out if rows is None else unpad_rows(out, [r * f for r in rows], axis=2)


def check_video_plan(plan: VAEPlan, vae=None, frame_hw=None, batch: int | None = None) -> None:
    """ValueError where `plan` cannot decode a video: tiles (a video has none here), and, given
    the VAE and a frame's latent (h, w), what `VAEPlan.validate` says of one frame."""
    if plan.mode == "tiles":
        raise ValueError(
            "vae_parallel='tiles': a video decodes on one device (off) or on row patches of "
            "every frame (rows)"
        )
    if vae is not None:
        plan.validate(vae, frame_hw, batch)


VIDEO_SPEC = P(DATA, None, PATCH)  # (B, F, h, w, C): videos over data, rows over patch


@partial(jax.jit, static_argnums=(0,))
def _whole_video(vae, params, z):
    return vae.decode(params, z)


@partial(jax.jit, static_argnums=(0, 3, 4))
def _video_rows(vae, params, z, mesh, rows):
    """The video decoder on row patches: z (B, F, h, w, C) sharded (data, -, patch), `rows`
    each patch's own where uneven (the slabs padded) -> frames sharded alike."""
    ops = patch_ops(mesh.shape[PATCH], "warmup", ulysses=1)  # exact: fresh halos, ring
    local = vae.with_ops(ops if rows is None else ops.with_rows(rows))
    fn = jax.shard_map(
        lambda p, zs: local.decode(p, zs),
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), params), VIDEO_SPEC),
        out_specs=VIDEO_SPEC,
        check_vma=False,
    )
    return fn(params, z)


def lowered_decode_video(vae, params, z_shape: tuple[int, ...], plan: VAEPlan, dtype=None):
    """The video decode program `plan` runs for a (B, F, h, w, C) latent, lowered (parameters
    may be abstract): its memory is read from it."""
    check_video_plan(plan, vae, z_shape[2:4], z_shape[0])
    dtype = dtype or vae.module.dtype
    if plan.whole:
        return _whole_video.lower(vae, params, jax.ShapeDtypeStruct(z_shape, dtype))
    mesh = make_mesh(plan.devices, 1, plan.data)
    rows = latent_rows(z_shape[2], plan.patch)
    shape = list(z_shape)
    if rows is not None:
        shape[2] = plan.patch * max(rows)
    z = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, VIDEO_SPEC))
    return _video_rows.lower(vae, params, z, mesh, rows)


# ------------------------------------------------------------------------------ tiles


@dataclass(frozen=True)
class Tiling:
    """diffusers' tiling of a (h, w) latent: tiles of `t` latent rows and columns starting every
    `stride`, blended over `blend` pixels, each cropped to `keep` pixels."""

    h: int
    w: int
    t: int  # tile side, latent
    f: int  # VAE factor

    @property
    def stride(self) -> int:
        return int(self.t * (1 - TILE_OVERLAP))

    @property
    def blend(self) -> int:
        return int(self.t * self.f * TILE_OVERLAP)

    @property
    def keep(self) -> int:
        return self.t * self.f - self.blend

    def starts(self, size: int) -> list[int]:
        return list(range(0, size, self.stride))

    def grid(self) -> list[list[tuple[int, int, int, int]]]:
        """(row, col, rows, cols) of every latent tile, by tile row (edge tiles are smaller)."""
        return [
            [(i, j, min(self.t, self.h - i), min(self.t, self.w - j)) for j in self.starts(self.w)]
            for i in self.starts(self.h)
        ]


def tiled_decode(vae, params, z: jax.Array, tile: int, devices: int = 1) -> jax.Array:
    """diffusers' `AutoencoderKL.tiled_decode` rule (tiles of `tile` pixels, a quarter
    overlapping, linear blends), the tiles decoded over `devices` devices, one at a time per
    device: (B, h, w, C) -> (B, H, W, 3). One program: the tiles, their decode and the blend."""
    f = vae.config.downsample_factor
    tiling = Tiling(z.shape[1], z.shape[2], tile // f, f)
    if devices == 1:
        return _tiled(vae, params, z, tiling, None)
    mesh = make_mesh(devices)  # every device on `patch`
    return _tiled(vae, params, _global(z, mesh, P()), tiling, mesh)


@partial(jax.jit, static_argnums=(0, 3, 4))
def _tiled(vae, params, z, tiling: Tiling, mesh):
    """Every tile in one loop per device, one tile at a time: tiles are laid out at the full
    tile size and each iteration decodes its tile's own rows and columns (edge tiles are
    smaller: up to four shapes, one branch each), padded back to the full size; then the tiles
    are cropped to their shapes and blended."""
    grid = tiling.grid()
    cells = [cell for row in grid for cell in row]
    shapes = sorted({(r, c) for _, _, r, c in cells})
    t = tiling.t
    tiles = jnp.stack(  # (T, B, t, t, C), edge tiles zero-padded (the padding is never read)
        [jnp.pad(z[:, i : i + r, j : j + c], ((0, 0), (0, t - r), (0, t - c), (0, 0)))
         for i, j, r, c in cells]
    )  # fmt: skip
    kind = jnp.asarray([shapes.index((r, c)) for _, _, r, c in cells], jnp.int32)
    n = 1 if mesh is None else mesh.devices.size
    if pad := -len(cells) % n:  # every device the same number of tiles
        tiles = jnp.concatenate([tiles, jnp.repeat(tiles[-1:], pad, axis=0)])
        kind = jnp.concatenate([kind, jnp.repeat(kind[-1:], pad)])
    body = partial(_decode_each, vae, tuple(shapes), tiling.f)
    if mesh is None:
        out = body(params, tiles, kind)
    else:
        out = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: P(), params), P(PATCH), P(PATCH)),
            out_specs=P(PATCH),
            check_vma=False,
        )(params, tiles, kind)
    f = tiling.f
    decoded, k = {}, 0
    for a, row in enumerate(grid):
        for b, (_, _, r, c) in enumerate(row):
            decoded[(a, b)] = out[k, :, : r * f, : c * f]  # (B, r*f, c*f, 3)
            k += 1
    return _blend(tiling, grid, decoded)


def _decode_each(vae, shapes, f, params, tiles, kind):
    """(T, B, t, t, C) tiles and their shape index (T,) -> (T, B, t*f, t*f, 3), one tile per
    iteration: branch k decodes the first shapes[k] rows and columns of its tile."""
    t = tiles.shape[2]

    def branch(r, c):
        def run(x):
            y = vae(params, x[:, :r, :c])  # (B, r*f, c*f, 3)
            return jnp.pad(y, ((0, 0), (0, (t - r) * f), (0, (t - c) * f), (0, 0)))

        return run

    branches = [branch(r, c) for r, c in shapes]
    return lax.map(lambda xk: lax.switch(xk[1], branches, xk[0]), (tiles, kind))


def _blend(tiling: Tiling, grid, decoded: dict) -> jax.Array:
    """Blend each tile with the one above and the one to its left (both already blended, as
    diffusers' in-place order leaves them), crop to `keep`, and join."""
    e = tiling.blend
    done: dict[tuple[int, int], jax.Array] = {}
    rows = []
    for a, row in enumerate(grid):
        parts = []
        for b in range(len(row)):
            tile = decoded[(a, b)]  # (B, r*f, c*f, 3)
            if a > 0:
                tile = _ramp(done[(a - 1, b)], tile, e, axis=1)
            if b > 0:
                tile = _ramp(done[(a, b - 1)], tile, e, axis=2)
            done[(a, b)] = tile
            parts.append(tile[:, : tiling.keep, : tiling.keep])
        rows.append(jnp.concatenate(parts, axis=2))
    return jnp.concatenate(rows, axis=1)


def _ramp(prev: jax.Array, tile: jax.Array, extent: int, axis: int) -> jax.Array:
    """tile's first `extent` lines along `axis` = prev's last ones x (1 - y/e) + its own x y/e."""
    e = min(prev.shape[axis], tile.shape[axis], extent)
    if e == 0:
        return tile
    wgt = (np.arange(e) / e).astype(np.float32)
    shape = [1] * tile.ndim
    shape[axis] = e
    wgt = jnp.asarray(wgt.reshape(shape), tile.dtype)
    head = lax.slice_in_dim(prev, prev.shape[axis] - e, prev.shape[axis], axis=axis)
    mixed = head * (1 - wgt) + lax.slice_in_dim(tile, 0, e, axis=axis) * wgt
    return jnp.concatenate([mixed, lax.slice_in_dim(tile, e, tile.shape[axis], axis=axis)], axis)


def lowered_decode(vae, params, z_shape: tuple[int, ...], plan: VAEPlan, dtype=None):
    """The decode program `plan` runs for a (B, h, w, C) latent, lowered (parameters may be
    abstract): memory and collectives are read from it (patchpar.measure)."""
    plan.validate(vae, z_shape[1:3], z_shape[0])
    dtype = dtype or vae.module.dtype
    if plan.whole:
        return _whole_decode.lower(vae, params, jax.ShapeDtypeStruct(z_shape, dtype))
    if plan.mode == "rows":
        mesh = make_mesh(plan.devices, 1, plan.data)
        sharding = NamedSharding(mesh, _spec(z_shape[1], plan.patch))
        z = jax.ShapeDtypeStruct(z_shape, dtype, sharding=sharding)
        return _rows.lower(vae, params, z, mesh, "decode")
    f = vae.config.downsample_factor
    tiling = Tiling(z_shape[1], z_shape[2], plan.tile_size(vae) // f, f)
    mesh = make_mesh(plan.devices) if plan.devices > 1 else None
    sharding = None if mesh is None else NamedSharding(mesh, P())
    z = jax.ShapeDtypeStruct(z_shape, dtype, sharding=sharding)
    return _tiled.lower(vae, params, z, tiling, mesh)


def tile_count(latent_hw: tuple[int, int], tile: int, f: int) -> int:
    """How many tiles diffusers' rule decodes for a (h, w) latent."""
    t = Tiling(*latent_hw, tile // f, f)
    return len(t.starts(t.h)) * len(t.starts(t.w))


__all__ = [
    "MODES", "VAEPlan", "check_video_plan", "decode", "decode_video", "encode", "lowered_decode",
    "lowered_decode_video", "tile_count", "tiled_decode",
]  # fmt: skip
