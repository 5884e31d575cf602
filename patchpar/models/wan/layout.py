"""How a video latent (B, F, H, W, C) lies in the tall image a Wan transformer reads: a `Video`
layout (`frames`, `rows` or an `FxR` grid of blocks), its checks against the patch devices, the
(frame, token row) of each tall-image row, and the video each of n naive patches holds."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("frames", "rows")  # and "FxR": a grid of F frame blocks x R row blocks


@dataclass(frozen=True)
class Video:
    """How a video latent of `frames` frames lies in the tall image the model reads (see the
    module docstring): `layout` is `frames`, `rows` or `FxR` (F frame blocks x R row blocks)."""

    frames: int = 1
    layout: str = "frames"

    def __post_init__(self):
        grid(self.layout)  # validates

    def check(self, token_rows: int, patches: int | None = None) -> None:
        """ValueError, naming the values and what fits, where this layout cannot cut a video of
        `token_rows` token rows per frame into `patches` patches (None: one device, only the
        grid's blocks checked): a frame split needs a latent frame per patch at least, and a
        grid's factors multiply to the patches and divide the frames and the token rows."""
        f = self.frames
        fb, rb = grid(self.layout)
        if patches is not None and patches > 1 and self.layout == "frames" and f < patches:
            raise ValueError(
                f"layout='frames' over {patches} patch devices: the video has {f} latent "
                f"frame(s), fewer than the devices; give at least {patches} latent frames "
                f"(frames >= {4 * (patches - 1) + 1} with Wan's VAE), or layout 'rows' or a grid"
            )
        if self.layout in LAYOUTS:
            return
        n = fb * rb if patches is None else patches
        fits = [f"{a}x{n // a}" for a in range(1, n + 1)
                if n % a == 0 and f % a == 0 and token_rows % (n // a) == 0]  # fmt: skip
        fit = f"grids that fit: {fits}" if fits else "no grid fits: use layout frames or rows"
        if fb * rb != n:
            raise ValueError(
                f"layout={self.layout!r}: {fb} x {rb} = {fb * rb} blocks for {n} patch devices; "
                f"the factors must multiply to the devices ({fit})"
            )
        if f % fb or token_rows % rb:
            raise ValueError(
                f"layout={self.layout!r}: {fb} frame blocks x {rb} row blocks do not divide the "
                f"video's {f} latent frames x {token_rows} token rows per frame ({fit})"
            )

    def patch(self, n: int, token_rows: int) -> Video:
        """The video each of `n` even row patches of the tall image holds, as a whole video of
        its own (naive patch: each device denoises its slab alone, its positions its own):
        `frames` a run of F / n frames, `rows` every frame's Hp / n token rows, a grid's block
        F / fb frames x Hp / rb rows (laid out as frames); ValueError where the slabs are not
        such videos (a slab cutting a frame), naming what fits. `token_rows`: Hp a frame."""
        f, fb = self.frames, grid(self.layout)[0]
        if n == 1:
            return self
        self.check(token_rows, n)  # a grid's blocks the devices, frames at least one each
        cut = {"frames": (f, "latent frames", "rows"), "rows": (token_rows, "token rows a frame",
               "frames")}.get(self.layout)  # fmt: skip
        if cut is not None and cut[0] % n:
            count, what, other = cut
            fits = [d for d in range(2, count + 1) if count % d == 0]
            raise ValueError(
                f"layout={self.layout!r} with each of {n} patches denoised alone (naive_patch): "
                f"{count} {what} do not split into {n} whole videos; devices that divide them: "
                f"{fits}, or layout {other!r} or a grid"
            )
        if self.layout == "rows":
            return self
        return Video(f // (n if self.layout == "frames" else fb), "frames")

    def units(self, rows: int, p: int) -> np.ndarray:
        """(rows / p,) the (frame, token row) of each token row of a tall image of `rows`
        latent rows (p latent rows per token row), in the layout's order: (n, 2) int."""
        f = self.frames
        hp = rows // p // f  # token rows per frame
        fb, rb = grid(self.layout)
        fr = np.stack(np.meshgrid(np.arange(f), np.arange(hp), indexing="ij"), -1)  # (F, Hp, 2)
        if self.layout == "rows":
            return fr.transpose(1, 0, 2).reshape(-1, 2)
        # blocks of (F / fb) frames x (Hp / rb) rows, block-major (frames: one block of all)
        blocks = fr.reshape(fb, f // fb, rb, hp // rb, 2).transpose(0, 2, 1, 3, 4)
        return blocks.reshape(-1, 2)

    def to_tall(self, x: jax.Array, p: int) -> jax.Array:
        """(B, F, H, W, C) -> (B, F x H, W, C) in the layout's order."""
        b, f, h, w, c = x.shape
        units = x.reshape(b, f, h // p, p, w, c)
        order = self.units(f * h, p)
        return units[:, order[:, 0], order[:, 1]].reshape(b, f * h, w, c)

    def from_tall(self, x: jax.Array, p: int) -> jax.Array:
        """The inverse of `to_tall`: (B, F x H, W, C) -> (B, F, H, W, C)."""
        b, r, w, c = x.shape
        f = self.frames
        order = self.units(r, p)
        units = x.reshape(b, r // p, p, w, c)
        out = jnp.zeros((b, f, r // p // f, p, w, c), x.dtype)
        out = out.at[:, order[:, 0], order[:, 1]].set(units)
        return out.reshape(b, f, r // f, w, c)


def grid(layout: str) -> tuple[int, int]:
    """(frame blocks, row blocks) of a layout name: `frames` (1, 1) as one block, `rows`,
    `FxR`; ValueError naming what fits."""
    if layout in LAYOUTS:
        return (1, 1)
    parts = layout.split("x") if isinstance(layout, str) else []
    if len(parts) == 2 and all(s.isdigit() and int(s) >= 1 for s in parts):
        return int(parts[0]), int(parts[1])
    raise ValueError(
        f"layout={layout!r}; known: {list(LAYOUTS)} or FxR (frame blocks x row blocks, e.g. 2x4)"
    )
