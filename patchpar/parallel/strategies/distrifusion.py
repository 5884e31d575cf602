"""`distrifusion`: displaced patch parallelism (Li et al., CVPR 2024, arXiv 2402.19430).
After `warmup_steps + 1` exact steps, every site uses the previous step's activations of the
other patches (halos, all K/V, GroupNorm statistics) and refreshes them asynchronously."""

from dataclasses import dataclass

from patchpar.parallel.sites import PatchOps
from patchpar.parallel.strategies.base import StaleStrategy


@dataclass(frozen=True)
class DistriFusion(StaleStrategy):
    name = "distrifusion"
    # after warm-up exchange nothing: halos, K/V and GN statistics stay as at the last warm-up step
    no_sync: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.no_sync and self.gn == "sync":
            raise ValueError(
                f"{self.name}: gn='sync' exchanges every step, no_sync=True exchanges nothing; pick one"
            )

    def ops(self, phase: str, n: int) -> PatchOps:
        return PatchOps(
            n, phase, halo_mode="stale", gn=self.gn, kv="stale", exchange=not self.no_sync
        )
