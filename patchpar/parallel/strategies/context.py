"""`ring` and `ulysses`: exact context parallelism for self-attention over the row patches
(xDiT's sequence parallelism; diffusers' `ContextParallelConfig(ring_degree, ulysses_degree)`).
Convolution halos and GroupNorm are exchanged fresh every step as in `sync_patch`; self-attention
is Ring (K/V passed around the patch axis), Ulysses (all-to-all to head-sharded and back) or
their hybrid, `ring_degree x ulysses_degree` = the patch axis (`patchpar.parallel.sites.context`).
The output equals `single`."""

from dataclasses import dataclass
from typing import ClassVar

from patchpar.parallel.codecs import wire_codecs
from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.sites.context import QKVO, check_degrees
from patchpar.parallel.strategies.base import Coded, Strategy, option
from patchpar.parallel.strategies.sync_patch import WIRE_HELP, wire_coded


@dataclass(frozen=True)
class ContextParallel(Strategy):
    name = "context"
    # which attention takes the whole patch axis when no degree is given
    whole: ClassVar[str] = "ring"
    ring_degree: int | None = option(
        None,
        "devices in the K/V ring (xDiT's ring_degree); ring x ulysses = the patch axis (ring's "
        "default: all of it; with ulysses_degree the other follows).",
    )
    ulysses_degree: int | None = option(
        None,
        "devices in each Ulysses all-to-all group (xDiT's ulysses_degree; ulysses' default: the "
        "whole patch axis). Heads that do not divide it are padded with zero heads.",
    )
    wire: str = option(
        "none",
        WIRE_HELP.format(
            kinds="q, k, v, o (attention's) and halo",
            example="q=fp8,v=fp8,o=fp8: cache-dit's FP8 all-to-all, K as it is",
        ),
        quiet=True,
    )

    def __post_init__(self):
        self.codecs()

    def codecs(self) -> dict:
        return wire_codecs(self.wire, (*QKVO, "halo"), self.name)

    def coded(self) -> Coded | None:
        keys = {**dict.fromkeys(QKVO, "kv"), "halo": "halo"}  # Q, K, V, O: attention's
        return wire_coded(self.name, self.wire, self.codecs(), keys)

    def degrees(self, patch: int) -> tuple[int, int]:
        """(ring, ulysses) on a patch axis of `patch` devices."""
        if self.ring_degree is None and self.ulysses_degree is None:
            return (patch, 1) if self.whole == "ring" else (1, patch)
        return check_degrees(patch, self.ring_degree, self.ulysses_degree, self.name)

    def ops(self, phase: str, n: int) -> PatchOps:
        del phase
        _, ulysses = self.degrees(n)
        return patch_ops(n, ulysses=ulysses, wire=self.codecs())

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        _, ulysses = self.degrees(patch)
        named = "=" in self.wire  # one codec for all: what the ring sends of them
        idle = sorted(set(self.codecs()) & {"q", "o"}) if ulysses == 1 and named else []
        if idle:
            raise ValueError(
                f"{self.name}: wire={self.wire!r} codes {idle}, which only Ulysses' all-to-alls "
                f"send; a ring of {patch} devices sends K and V (use k=, v=, or ulysses_degree "
                f"> 1)"
            )


@dataclass(frozen=True)
class Ring(ContextParallel):
    """Ring attention; with ulysses_degree > 1 the hybrid (Ulysses inside groups)."""

    name = "ring"


@dataclass(frozen=True)
class Ulysses(ContextParallel):
    """Ulysses attention; with ring_degree > 1 the hybrid (a ring across the groups)."""

    name = "ulysses"
    whole = "ulysses"
