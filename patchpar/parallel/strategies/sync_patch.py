"""`sync_patch`: exact patch parallelism. Every step exchanges fresh halos, all-reduces GroupNorm
statistics and all-gathers self-attention K/V; the output equals `single` (docs/design.md §4).
With `wire` the halos and K/V go coded (fp8 or int8 per token: `codecs.to_rows`); GroupNorm
statistics stay exact."""

from dataclasses import dataclass

from patchpar.parallel.codecs import WIRE, wire_codecs
from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.strategies.base import Coded, Strategy, option

WIRE_HELP = (
    "codes every exchange of activations on the wire, per token (a scale per token, so nothing "
    f"overflows): {', '.join(WIRE)} (default none; fp8 is e4m3), for all of {{kinds}}, or "
    "kind=codec pairs of the kinds the model has ({example}); the output then differs from "
    "single by the codec's rounding."
)


def wire_coded(who: str, wire: str, codecs: dict, keys: dict[str, str]) -> Coded | None:
    """What an exact strategy's `wire` codes (`codecs`: {kind: codec} of those coded; `keys`:
    {every kind it may name: the site kind that sends it}); None: nothing."""
    if not codecs:
        return None
    named = tuple(codecs) if "=" in wire else ()
    return Coded(f"{who}: wire={wire!r}", keys, tuple(codecs), named)


@dataclass(frozen=True)
class SyncPatch(Strategy):
    name = "sync_patch"
    wire: str = option("none", WIRE_HELP.format(kinds="halo, kv", example="kv=fp8"), quiet=True)

    def __post_init__(self):
        self.codecs()

    def codecs(self) -> dict:
        return wire_codecs(self.wire, ("halo", "kv"), self.name)

    def coded(self) -> Coded | None:
        return wire_coded(self.name, self.wire, self.codecs(), {"halo": "halo", "kv": "kv"})

    def ops(self, phase: str, n: int) -> PatchOps:
        return patch_ops(n, wire=self.codecs())
