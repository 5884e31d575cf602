"""Site 1, the conv halo: a spatial convolution on a row slab needs `top` / `bottom` rows of
its neighbours (docs/design.md §2). Halos go to the neighbours only (`down` / `up`); an edge
device receives zeros, which is the convolution's zero padding.

Modes: `fresh` (exchanged every step), `stale` (the previous step's rows, refreshed for the
next step; exact during warm-up, which writes the first buffer), `zero` (nothing exchanged:
naive patches). `exchange=False` is DistriFusion's no_sync: the buffer stays as at the last
warm-up step. Buffer `halo`: (B, top + bottom, W, C), the rows above then the rows below.
With a `link` the steady phase's rows are compressed (and may be extrapolated), stale or fresh
(`sites.compress`); the model's first conv stays exact.

Uneven patches (`rows`): a slab holds its patch's rows, then padding; it sends its last own
rows down, and the rows from below go right under its last own row (where the padding
starts), so its own rows convolve as in the whole image (the rows after them are padding's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.parallel.sites.common import STALE, PatchSite, nbytes, note

MODES = ("fresh", "stale", "zero")


@dataclass(frozen=True)
class Halo(PatchSite):
    kind = "halo"
    buffers = ("halo",)
    mode: str = "fresh"
    exchange: bool = True  # steady phase: refresh the buffer (False: DistriFusion's no_sync)
    input: bool = False  # the model's first conv (`input_layer()`): fresh whatever the mode

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"halo mode={self.mode!r}; known: {list(MODES)}")

    def input_layer(self) -> Halo:
        """`conv_in` reads the latent itself, which the sampler updates every step: a stale halo
        would be last step's input (with Euler, under last step's input scaling), so it is
        exchanged fresh (2 rows x W x C_in per neighbour). `zero` (naive patch) stays zero."""
        mode = "fresh" if self.mode == "stale" else self.mode
        # exact: the latent is small
        return replace(self, mode=mode, input=True, link=None, wire=None)

    def __call__(self, mod, x: jax.Array, top: int, bottom: int) -> jax.Array:
        """(B, h, W, C) -> (B, top + h + bottom, W, C)."""
        note(self, shape=x.shape, itemsize=x.dtype.itemsize, top=top, bottom=bottom)
        if self.n == 1 or not top + bottom or (self.mode == "zero" and self.split is None):
            return jnp.pad(x, ((0, 0), (top, bottom), (0, 0), (0, 0)))
        if self.mode == "zero":  # uneven: the zeros below go under the patch's own rows
            zeros = jnp.zeros((x.shape[0], top + bottom) + x.shape[2:], x.dtype)
            return self._around(x, zeros, top)
        sends = self._sends(x, top, bottom)
        if self.warmup or self.mode == "fresh":
            buf = self.receive(self.exchange_now(mod, sends))["halo"]
            if self.mode == "stale":  # warm-up: the buffer the steady phase reads first
                mod.put_variable(STALE, "halo", buf)
        else:
            shape = (x.shape[0], top + bottom) + x.shape[2:]
            buf = mod.variable(STALE, "halo", jnp.zeros, shape, x.dtype).value
            if self.exchange:
                self.send(mod, sends)
        return self._around(x, buf, top)

    def _around(self, x, buf, top: int) -> jax.Array:
        """x with the rows above (`buf[:, :top]`) and below (the rest) around its own rows."""
        if self.split is None:
            return jnp.concatenate([buf[:, :top], x, buf[:, top:]], axis=1)
        below = buf[:, top:]
        y = jnp.concatenate([buf[:, :top], x, jnp.zeros_like(below)], axis=1)
        return lax.dynamic_update_slice_in_dim(y, below, top + self.split.mine(x.shape[1]), 1)

    def _sends(self, x, top: int, bottom: int) -> dict[str, jax.Array]:
        """My last `top` rows go down (the next patch's rows above), my first `bottom` rows up."""
        sends = {}
        if top and self.split is None:
            sends["down"] = x[:, x.shape[1] - top :]
        elif top:
            sends["down"] = lax.dynamic_slice_in_dim(x, self.split.mine(x.shape[1]) - top, top, 1)
        if bottom:
            sends["up"] = x[:, :bottom]
        return sends

    def receive(self, got):
        return {"halo": jnp.concatenate([got[c] for c in ("down", "up") if c in got], axis=1)}

    def sends_stale(self) -> bool:
        return self.mode == "stale" and self.exchange and not self.input

    def _exchanged(self) -> bool:
        """Whether this call exchanges anything (no_sync's steady phase does not)."""
        return self.mode != "zero" and (self.warmup or self.mode == "fresh" or self.exchange)

    def received_bytes(self, info, p):
        if self.n == 1 or not self._exchanged():
            return 0
        b, _, w, c = info["shape"]
        rows = (info["top"] if p > 0 else 0), (info["bottom"] if p < self.n - 1 else 0)
        return sum(self.wire_bytes((b, r, w, c), info["itemsize"]) for r in rows if r)

    def released_bytes(self, info, p):
        """The released code all-gathers every 3x3 conv's top and bottom `padding` rows from
        every device but the first conv's (which slices the full latent: nothing is sent);
        no_sync sends nothing after warm-up."""
        if self.n == 1 or self.input or not self._exchanged():
            return 0
        per_row = nbytes(info) // info["shape"][1]
        return (self.n - 1) * 2 * max(info["top"], info["bottom"]) * per_row
