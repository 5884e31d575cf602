"""`distrifusion`: displaced patch parallelism (Li et al., CVPR 2024, arXiv 2402.19430).
After `warmup_steps + 1` exact steps, every site uses the previous step's activations of the
other patches (halos, all K/V, GroupNorm statistics) and refreshes them asynchronously."""

from dataclasses import dataclass

from patchpar.parallel.sites import PatchOps
from patchpar.parallel.strategies.base import Strategy

GN_MODES = ("separate", "stale", "corrected", "sync")


def check_warmup(name: str, warmup_steps: int, steps: int) -> None:
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"{name}: warmup_steps={warmup_steps!r} must be an integer >= 0")
    if warmup_steps >= steps:
        raise ValueError(
            f"{name}: warmup_steps={warmup_steps} must be < steps={steps} (the first warmup_steps + 1 "
            f"steps run synchronously); use warmup_steps <= {steps - 1}"
        )


def check_gn(name: str, gn: str, no_sync: bool) -> None:
    if gn not in GN_MODES:
        raise ValueError(f"{name}: gn={gn!r}; known: {list(GN_MODES)}")
    if no_sync and gn == "sync":
        raise ValueError(
            f"{name}: gn='sync' exchanges every step, no_sync=True exchanges nothing; pick one"
        )


@dataclass(frozen=True)
class DistriFusion(Strategy):
    name = "distrifusion"
    # synchronous steps before going stale: the first warmup_steps + 1 (paper §4.3, default 4)
    warmup_steps: int = 4
    # GroupNorm after warm-up (paper Table 5): separate | stale | corrected (Eq. 2) | sync
    gn: str = "corrected"
    # after warm-up exchange nothing: halos, K/V and GN statistics stay as at the last warm-up step
    no_sync: bool = False

    def __post_init__(self):
        check_gn(self.name, self.gn, self.no_sync)

    def sync_steps(self, steps: int) -> int:
        return min(steps, self.warmup_steps + 1)

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        check_warmup(self.name, self.warmup_steps, steps)

    def ops(self, phase: str, n: int) -> PatchOps:
        return PatchOps(
            n, phase, halo_mode="stale", gn=self.gn, kv="stale", exchange=not self.no_sync
        )
