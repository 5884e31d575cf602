"""An MMDiT's text stream (docs/design.md §2): every device holds the whole text stream and
computes it itself. Under an exact strategy the devices' copies stay equal; under a stale one
each device's text queries read the other patches' stale image K/V, so the copies drift apart.
This site, called on the text tokens after every block, says how the steady phase keeps them:

- `own` (default): each device keeps its own copy; nothing is exchanged, and the steady phase
  keeps DistriFusion's property that no collective blocks the compute.
- `mean`: the copies are averaged over the patch axis after every block (an all-reduce of
  (B, S, D) per block).
- `first`: every device takes patch 0's copy after every block (xDiT's PipeFusion keeps the
  text stream of its first patch; here an all-gather of (B, S, D) per block, patch 0's kept).

In the warm-up phase the copies are equal (every exchange is exact), so nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from patchpar.parallel.sites.common import PatchSite, exchange, nbytes, note

MODES = ("own", "mean", "first")


@dataclass(frozen=True)
class TextStream(PatchSite):
    kind = "text"
    mode: str = "own"

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"text={self.mode!r}; known: {list(MODES)}")

    def _exchanged(self) -> bool:
        return self.n > 1 and not self.warmup and self.mode != "own"

    def __call__(self, mod, txt: jax.Array) -> jax.Array:
        """The text tokens (B, S, D) after a block -> the copy this device keeps."""
        del mod
        note(self, shape=txt.shape, itemsize=txt.dtype.itemsize)
        if not self._exchanged():
            return txt
        if self.mode == "mean":
            return exchange(self.kind, [{"mean": txt}], self.n, self.local)[0]["mean"]
        return exchange(self.kind, [{"gather": txt}], self.n, self.local)[0]["gather"][0]

    def received_bytes(self, info, p):
        if not self._exchanged():
            return 0
        if self.mode == "mean":
            return 2 * (self.n - 1) * nbytes(info) // self.n  # ring all-reduce
        return (self.n - 1) * nbytes(info)  # all-gather
