"""Site 1, the conv halo: a spatial convolution on a row slab needs `top` / `bottom` rows of
its neighbours (docs/design.md §2). Halos go to the neighbours only (`down` / `up`); an edge
device receives zeros, which is the convolution's zero padding.

Modes: `fresh` (exchanged every step), `stale` (the previous step's rows, refreshed for the
next step; exact during warm-up, which writes the first buffer), `zero` (nothing exchanged:
naive patches). `exchange=False` is DistriFusion's no_sync: the buffer stays as at the last
warm-up step. Buffer `halo`: (B, top + bottom, W, C), the rows above then the rows below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from patchpar.parallel.sites.common import STALE, PatchSite, exchange, nbytes, note

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
        return replace(self, mode="fresh" if self.mode == "stale" else self.mode, input=True)

    def __call__(self, mod, x: jax.Array, top: int, bottom: int) -> jax.Array:
        """(B, h, W, C) -> (B, top + h + bottom, W, C)."""
        note(self, shape=x.shape, itemsize=x.dtype.itemsize, top=top, bottom=bottom)
        if self.mode == "zero" or self.n == 1 or not top + bottom:
            return jnp.pad(x, ((0, 0), (top, bottom), (0, 0), (0, 0)))
        sends = self._sends(x, top, bottom)
        if self.warmup or self.mode == "fresh":
            buf = self.receive(exchange(self.kind, [sends], self.n, self.local)[0])["halo"]
            if self.mode == "stale":  # warm-up: the buffer the steady phase reads first
                mod.variable(STALE, "halo", lambda: buf)
        else:
            shape = (x.shape[0], top + bottom) + x.shape[2:]
            var = mod.variable(STALE, "halo", jnp.zeros, shape, x.dtype)
            buf = var.value
            if self.exchange and (got := self.send(mod, sends)) is not None:
                var.value = self.receive(got)["halo"]
        return jnp.concatenate([buf[:, :top], x, buf[:, top:]], axis=1)

    @staticmethod
    def _sends(x, top: int, bottom: int) -> dict[str, jax.Array]:
        """My last `top` rows go down (the next patch's rows above), my first `bottom` rows up."""
        sends = {}
        if top:
            sends["down"] = x[:, x.shape[1] - top :]
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
        per_row = nbytes(info) // info["shape"][1]
        return per_row * ((info["top"] if p > 0 else 0) + (info["bottom"] if p < self.n - 1 else 0))

    def released_bytes(self, info, p):
        """The released code all-gathers every 3x3 conv's top and bottom `padding` rows from
        every device but the first conv's (which slices the full latent: nothing is sent);
        no_sync sends nothing after warm-up."""
        if self.n == 1 or self.input or not self._exchanged():
            return 0
        per_row = nbytes(info) // info["shape"][1]
        return (self.n - 1) * 2 * max(info["top"], info["bottom"]) * per_row
