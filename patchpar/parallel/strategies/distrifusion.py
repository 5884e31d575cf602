"""`distrifusion`: displaced patch parallelism (Li et al., CVPR 2024, arXiv 2402.19430).
After `warmup_steps + 1` exact steps, every site uses the previous step's activations of the
other patches (halos, all K/V, GroupNorm statistics) and refreshes them for the next step,
exchanged together in `comm_groups` groups (or per site), optionally compressed (`codec`,
`residual`) or extrapolated from the last two (`extrapolate`).

`no_sync=True` is the released code's `no_sync` mode: after warm-up nothing is exchanged; halos
and K/V stay as at the last warm-up step and GroupNorm is local, so it needs `gn='separate'`."""

from dataclasses import dataclass

from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.strategies.base import StaleStrategy, option


@dataclass(frozen=True)
class DistriFusion(StaleStrategy):
    name = "distrifusion"
    no_sync: bool = option(
        False,
        "exchange nothing after warm-up: halos and K/V as at the last warm-up step, GroupNorm "
        'local (DistriFusion Table 4, "no sync"; the released code\'s mode="no_sync").',
    )

    def __post_init__(self):
        super().__post_init__()
        if self.no_sync and self.gn != "separate":
            raise ValueError(
                f"{self.name}: no_sync=True exchanges nothing after warm-up, so GroupNorm is local "
                f"then (the released code's no_sync mode); it needs gn='separate', got gn={self.gn!r}"
            )
        if self.no_sync and self.links():
            raise ValueError(
                f"{self.name}: no_sync=True exchanges nothing after warm-up: there is nothing to "
                f"compress or extrapolate (codec={self.codec!r}, extrapolate={self.extrapolate!r}); "
                f"use no_sync=False"
            )

    def ops(self, phase: str, n: int) -> PatchOps:
        return patch_ops(
            n,
            phase,
            halo="stale",
            gn=self.gn,
            kv="stale",
            exchange=not self.no_sync,
            packed=self.packs(phase),
            links=self.links(),
            text=self.text,
        )
