"""`pcpp`: partially conditioned patch parallelism (arXiv 2412.02962). As DistriFusion, except
that after warm-up a patch attends to its own fresh K/V plus stale bands of only its two
neighbours: the last `portion` of the patch above and the first `portion` of the patch below."""

from dataclasses import dataclass

from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.sites.kv import ALIGNS, SENDS
from patchpar.parallel.strategies.base import StaleStrategy, option


@dataclass(frozen=True)
class PCPP(StaleStrategy):  # warm-up and GroupNorm as DistriFusion's
    name = "pcpp"
    portion: float = option(
        0.3,
        "share of each neighbour patch attended to, in (0, 1] (default 0.3: PCPP's code "
        "hard-codes it; PCPP §3.2).",
    )
    send: str = option(
        "full",
        "full (the whole neighbour K/V, cropped at the receiver, as PCPP's code; default) or "
        "band (only the rows used).",
    )
    align: str = option(
        "tokens",
        "tokens (the band is portion x the patch's tokens, as PCPP's code; default) or rows "
        "(portion x its image rows, rounded up to whole rows: a DiT's token rows, a UNet "
        "level's pixel rows).",
        quiet=True,
    )

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.portion, (int, float)) or not 0 < self.portion <= 1:
            raise ValueError(
                f"pcpp: portion={self.portion!r} must be in (0, 1] (1 = whole neighbour patches)"
            )
        if self.send not in SENDS:
            raise ValueError(f"pcpp: send={self.send!r}; known: {list(SENDS)}")
        if self.align not in ALIGNS:
            raise ValueError(f"pcpp: align={self.align!r}; known: {list(ALIGNS)}")

    def ops(self, phase: str, n: int) -> PatchOps:
        return patch_ops(
            n,
            phase,
            halo="stale",
            gn=self.gn,
            kv="band",
            portion=float(self.portion),
            send=self.send,
            align=self.align,
            packed=self.packs(phase),
            links=self.links(),
            text=self.text,
        )
