"""`pcpp`: partially conditioned patch parallelism (arXiv 2412.02962). As DistriFusion, except
that after warm-up a patch attends to its own fresh K/V plus stale bands of only its two
neighbours: the last `portion` of the patch above and the first `portion` of the patch below."""

from dataclasses import dataclass

from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.strategies.base import StaleStrategy

SENDS = ("full", "band")


@dataclass(frozen=True)
class PCPP(StaleStrategy):  # warm-up and GroupNorm as DistriFusion's
    name = "pcpp"
    # share of each neighbour patch's tokens kept (PCPP's code hard-codes 0.3, never ablated)
    portion: float = 0.3
    # full: send the whole neighbour K/V and crop at the receiver (PCPP's code); band: only the rows used
    send: str = "full"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.portion, (int, float)) or not 0 < self.portion <= 1:
            raise ValueError(
                f"pcpp: portion={self.portion!r} must be in (0, 1] (1 = whole neighbour patches)"
            )
        if self.send not in SENDS:
            raise ValueError(f"pcpp: send={self.send!r}; known: {list(SENDS)}")

    def ops(self, phase: str, n: int) -> PatchOps:
        return patch_ops(
            n,
            phase,
            halo="stale",
            gn=self.gn,
            kv="band",
            portion=float(self.portion),
            send=self.send,
            packed=self.packs(phase),
        )
