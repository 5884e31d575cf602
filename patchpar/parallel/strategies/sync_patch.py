"""`sync_patch`: exact patch parallelism. Every step exchanges fresh halos, all-reduces GroupNorm
statistics and all-gathers self-attention K/V; the output equals `single` (docs/design.md §4)."""

from dataclasses import dataclass

from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.strategies.base import Strategy


@dataclass(frozen=True)
class SyncPatch(Strategy):
    name = "sync_patch"

    def ops(self, phase: str, n: int) -> PatchOps:
        return patch_ops(n)
