"""Strategy registry: `make_strategy(name, **options)`; unknown names or options are errors
that list the known ones."""

from __future__ import annotations

from patchpar.parallel.strategies.asyncdiff import AsyncDiff
from patchpar.parallel.strategies.base import Strategy
from patchpar.parallel.strategies.compact import Compact
from patchpar.parallel.strategies.context import Ring, Ulysses
from patchpar.parallel.strategies.distrifusion import DistriFusion
from patchpar.parallel.strategies.naive_patch import NaivePatch
from patchpar.parallel.strategies.pcpp import PCPP
from patchpar.parallel.strategies.pipefusion import PipeFusion
from patchpar.parallel.strategies.single import Single
from patchpar.parallel.strategies.sync_patch import SyncPatch
from patchpar.parallel.strategies.tensor import Tensor

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        Single,
        NaivePatch,
        SyncPatch,
        DistriFusion,
        PCPP,
        Compact,
        Ring,
        Ulysses,
        Tensor,
        PipeFusion,
        AsyncDiff,
    )
}


def make_strategy(name: str, **options) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {list(STRATEGIES)}") from None
    known = cls.option_names()
    bad = sorted(set(options) - set(known))
    if bad:
        why = [COMBINE[o] for o in bad if o in COMBINE]
        raise ValueError(
            f"strategy {name!r} has no option(s) {bad}; its options: {known or 'none'}"
            + (f" ({'; '.join(why)})" if why else "")
        )
    return cls(**options)


# Why a degree of another parallelism does not combine with the strategy that lacks it
_CONTEXT = (
    "Ring and Ulysses combine with each other only (`ring --ulysses-degree U` or `ulysses "
    "--ring-degree R`); they replace the self-attention exchange of the patch axis"
)
COMBINE = {
    "tp_degree": "tensor parallelism combines with exact row patches only, as `tensor "
    "--tp-degree M` (the rest of an image's devices are sync_patch patches): the stale "
    "strategies' buffers hold whole activations",
    "ring_degree": _CONTEXT,
    "ulysses_degree": _CONTEXT,
    "comm_groups": "comm_groups packs the steady phase's stale exchange, which only "
    "distrifusion and pcpp have; the other strategies exchange fresh activations at each site, "
    "as the layer needs them",
    **dict.fromkeys(
        ("codec", "residual", "extrapolate"),
        "compressed or extrapolated exchange applies to the activations that distrifusion and "
        "pcpp exchange stale and compact exchanges fresh; naive_patch and single exchange "
        "nothing, and the exact strategies' exchanges stay exact",
    ),
}


__all__ = ["STRATEGIES", "Strategy", "make_strategy"]
