"""Site 2, GroupNorm statistics: per-group E[x] and E[x^2] over the whole image from each
patch's own (docs/design.md §2). Both moments travel as one (2, B, G) float32 payload.

Modes after warm-up (DistriFusion Table 5): `sync` (exact mean over the patch axis every step),
`separate` (local statistics), `stale` (own fresh, the others' as at step t-1), `corrected`
(DistriFusion Eq. 2: stale global + fresh local - stale local; where the estimated variance is
negative, the local variance). During warm-up every mode is exact (the released code
all-reduces while counter <= warmup_steps) and the stale modes write their buffers
`gn_global` (the exact mean) and `gn_local` (this patch's own), each (2, B, G).

Uneven patches (`rows`): each patch's moments are over its own rows (the layer counts them:
`SiteOps.own_rows`), and weighed by its rows in the mean over the patch axis, so that the
global moments are the whole image's; `stale` replaces this patch's share by its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from patchpar.parallel.sites.common import STALE, PatchSite, exchange, nbytes, note

MODES = ("separate", "stale", "corrected", "sync")  # DistriFusion Table 5's order


@dataclass(frozen=True)
class GroupStats(PatchSite):
    kind = "gn"
    buffers = ("gn_global", "gn_local")
    mode: str = "sync"

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"gn={self.mode!r}; known: {list(MODES)}")

    def __call__(self, mod, mean: jax.Array, mean_sq: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Local (B, G) E[x], E[x^2] -> the global estimate the mode gives."""
        act = jnp.dtype(getattr(mod, "dtype", jnp.float32)).itemsize  # the activation's dtype
        note(self, shape=(2,) + mean.shape, itemsize=4, act_itemsize=act)
        if self.n == 1 or not self._exchanged():
            return mean, mean_sq
        fresh = jnp.stack([mean, mean_sq])  # (2, B, G): one payload for both moments
        # a patch's share of the mean over the patch axis: its rows over the mean patch's
        weight = 1.0 if self.split is None else self.split.weight()
        stale_mode = self.mode in ("stale", "corrected")
        if self.warmup or self.mode == "sync":
            sent = fresh if self.split is None else fresh * weight
            glob = exchange(self.kind, [{"mean": sent}], self.n, self.local)[0]["mean"]
            if stale_mode:
                mod.put_variable(STALE, "gn_global", glob)
                mod.put_variable(STALE, "gn_local", fresh)
            return glob[0], glob[1]
        g = mod.variable(STALE, "gn_global", jnp.zeros, fresh.shape, fresh.dtype)
        loc = mod.variable(STALE, "gn_local", jnp.zeros, fresh.shape, fresh.dtype)
        if self.mode == "stale" and self.split is None:  # own slot fresh, others as at t-1
            est = g.value + (fresh - loc.value) / self.n
        elif self.mode == "stale":  # uneven: the own slot's share by its rows
            est = g.value + (fresh - loc.value) * weight / self.n
        else:  # corrected: DistriFusion Eq. 2
            est = g.value + (fresh - loc.value)
        self.send(mod, {"mean": fresh if self.split is None else fresh * weight})  # next gn_global
        loc.value = fresh
        e_mean, e_sq = est[0], est[1]
        if self.mode == "corrected":  # where the estimated variance is negative, the local one
            local_var = mean_sq - jnp.square(mean)
            e_sq = jnp.where(e_sq - jnp.square(e_mean) < 0, jnp.square(e_mean) + local_var, e_sq)
        return e_mean, e_sq

    def receive(self, got):
        return {"gn_global": got["mean"]}

    def sends_stale(self) -> bool:
        return self.mode in ("stale", "corrected")

    def _exchanged(self) -> bool:
        return self.warmup or self.mode != "separate"

    def received_bytes(self, info, p):
        if self.n == 1 or not self._exchanged():
            return 0
        return 2 * (self.n - 1) * nbytes(info) // self.n  # ring all-reduce

    def released_bytes(self, info, p):
        """The released code keeps the statistics in the activation dtype; its stale and
        corrected modes all-gather them, the others all-reduce them during warm-up (and `sync`
        every step); separate is local after warm-up."""
        if self.n == 1 or not self._exchanged():
            return 0
        size = nbytes(info) // info["itemsize"] * info["act_itemsize"]
        if self.mode in ("stale", "corrected"):
            return (self.n - 1) * size  # all-gather
        return 2 * (self.n - 1) * size // self.n
