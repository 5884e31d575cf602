"""Step caches: reuse across denoising steps (docs/design.md §3c).

A step cache decides, step by step, whether the denoiser's blocks run or their effect is
reused from an earlier step. It is orthogonal to the strategy (`Plan.cache`): the engine runs
it inside each device's program, a single device without one.

`fbcache` (first-block cache; ParaAttention, diffusers' `apply_first_block_cache`): every step
runs the transformer's first block; when the mean absolute change of that block's residual
(its output minus its input, image tokens) since the last step that ran every block, relative
to that residual's mean absolute value, is at most `threshold`, the other blocks are skipped
and their residuals of that step (image and text tokens) are added to the first block's output.
The first step always runs every block. Under patch parallelism the two means are sums over
every device's rows (and guidance halves and images: diffusers' mean is over the whole batch),
one all-reduce of two scalars, so every device takes the same branch and the decision is the
one device's. A skipped step runs the first block as the strategy says (its exchange
included) and its skipped blocks exchange nothing: their stale buffers (DistriFusion, PCPP)
keep what the last computed step sent, so a stale site's next read is from the last step that
ran it, not from the step before.

The model's side is its forward in three parts (`prologue`, `blocks(lo, hi)`, `epilogue`, with
`num_blocks`) that its `__call__` chains; a denoiser names the caches it has (`caches`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from patchpar.sampling.cache.base import (
    CACHE,
    CLOSEST,
    STEADY_COMPUTED,
    StepCache,
    cache_options,
    cache_report,
)
from patchpar.sampling.cache.deepcache import DeepCache
from patchpar.sampling.cache.firstblock import FirstBlockCache, TeaCache
from patchpar.sampling.cache.taylorseer import TaylorSeer

CACHES: dict[str, type[StepCache]] = {
    c.name: c for c in (FirstBlockCache, TaylorSeer, TeaCache, DeepCache)
}


@dataclass(frozen=True)
class Forced(StepCache):
    """`cache` with every step taking one branch (`compute` True: the blocks run; False: they
    are skipped or predicted): a program whose collectives are those of one kind of step, for
    counting bytes. Its images are not the cache's."""

    cache: StepCache
    compute: bool

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.cache.name

    def validate(self, denoiser, steps: int) -> None:
        self.cache.validate(denoiser, steps)

    def describe(self) -> str:
        return f"{self.cache.describe()} forced to {'compute' if self.compute else 'skip'}"

    def blocks_computed(self, num_blocks, steps, computed_steps):
        return self.cache.blocks_computed(num_blocks, steps, computed_steps)

    def call(self, model, state, reduce_sum, force=None):
        return self.cache.call(model, state, reduce_sum, self.compute)

    def bind(self, steps: int) -> Forced:
        return replace(self, cache=self.cache.bind(steps))


def make_cache(name: str | None, **options) -> StepCache | None:
    """The cache `name` with its options (None or "none": no cache); ValueError naming what
    fits."""
    if name in (None, "none"):
        if options:
            raise ValueError(f"cache options {sorted(options)} given without a cache")
        return None
    if name not in CACHES:
        raise ValueError(f"cache={name!r}; known: none, {', '.join(CACHES)}")
    cls = CACHES[name]
    known = {f.name for f in cache_options(cls)}
    if unknown := sorted(set(options) - known):
        raise ValueError(f"cache {name!r} has no option {unknown}; its options: {sorted(known)}")
    return cls(**options)


__all__ = [
    "CACHE",
    "CACHES",
    "CLOSEST",
    "STEADY_COMPUTED",
    "DeepCache",
    "FirstBlockCache",
    "Forced",
    "StepCache",
    "TaylorSeer",
    "TeaCache",
    "cache_options",
    "cache_report",
    "make_cache",
]
