"""`compact`: compressed synchronous patch parallelism (CompactFusion, arXiv 2507.17511). After
`warmup_steps + 1` exact steps, every step exchanges fresh activations as `sync_patch` does,
but compressed: each device sends the residual of its K/V (and with `codec=kv=..,halo=..` its
halo rows) against a base that sender and receiver keep identical, and uses the others'
reconstruction in the same step (docs/design.md §2b). GroupNorm statistics stay exact (`gn`
sync by default)."""

from dataclasses import dataclass

from patchpar.parallel.codecs import NAMES as CODECS
from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.strategies.base import StaleStrategy, option


@dataclass(frozen=True)
class Compact(StaleStrategy):
    name = "compact"
    warmup_steps: int = option(
        1,
        "the first warmup_steps + 1 steps run exactly (default 1: CompactFusion's one or two "
        "exact steps before compressing).",
    )
    gn: str = option(
        "sync",
        "GroupNorm after warm-up: sync (exact, default), or separate, stale, corrected as "
        "distrifusion's.",
    )
    codec: str = option(
        "int2",
        "one codec for K/V (default int2, CompactFusion's 2-bit) or one per site kind the model "
        f"has (kv=sign1,halo=int8); codecs {', '.join(CODECS)}; GroupNorm statistics stay exact.",
    )

    extrapolate: float = option(
        0.0,
        "must stay 0: compact uses this step's compressed activations, not stale ones.",
        quiet=True,
    )

    def __post_init__(self):
        super().__post_init__()
        if self.extrapolate:
            raise ValueError(
                f"{self.name}: extrapolate={self.extrapolate!r} estimates stale activations, but "
                f"compact uses this step's (compressed) ones; use extrapolate=0, or distrifusion / "
                f"pcpp with a codec for stale compressed exchange"
            )

    def ops(self, phase: str, n: int) -> PatchOps:
        return patch_ops(
            n,
            phase,
            halo="fresh",
            gn=self.gn,
            kv="all",
            packed=self.packs(phase),
            links=self.links(),
            text=self.text,
        )
