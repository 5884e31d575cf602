"""What every step cache shares: the `StepCache` interface, the loop state's names, the
record of a run's cache (`cache_report`, `CLOSEST`) and the checks of its options."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from typing import ClassVar

import jax
import jax.numpy as jnp

CACHE = "step_cache"  # the cache's state beside the stale buffers in the engine's loop state
STEADY_COMPUTED = "steady_computed"  # in it: the computed steps of a strategy's steady phase


class StepCache:
    """A step cache: options as dataclass fields, `validate`, `describe`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # a threshold cache skips no step in a run shorter than this (its threshold does not
    # depend on the run's length), and why
    min_steps: ClassVar[int] = 0
    min_steps_why: ClassVar[str] = ""

    def validate(self, denoiser, steps: int) -> None:
        if self.name not in denoiser.caches:
            have = ", ".join(denoiser.caches) or "none"
            raise ValueError(
                f"cache {self.name!r} does not exist for a {denoiser.family} denoiser ({self.summary}); "
                f"caches for it: {have}"
            )
        if steps < self.min_steps:
            raise self._inert(
                steps, "skipped", self.min_steps_why, f"at least {self.min_steps} steps"
            )

    def describe(self) -> str:
        opts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in cache_options(type(self)))
        return f"{self.name}({opts})"

    def _inert(self, steps: int, nothing: str, why: str, fit: str) -> ValueError:
        """The error for options that leave nothing to reuse in a run of `steps` steps."""
        return ValueError(
            f"{self.describe()} with {steps} steps: every step computes, nothing is {nothing}: "
            f"{why}; use {fit}"
        )

    def bind(self, steps: int) -> StepCache:
        """The cache for a run of `steps` steps (one that needs the count keeps it)."""
        return self

    def idle_options(self, steps: int) -> list[str]:
        """Options set that have no effect in a run of `steps` steps (the same run as without
        them), one line each: warnings, not errors (`validate` refuses what breaks the cache)."""
        return []

    def blocks_computed(self, num_blocks: int, steps: int, computed_steps: int) -> float:
        """The fraction of the denoiser's block calls that ran."""
        raise NotImplementedError

    def schedule(self, steps: int) -> list[bool] | None:
        """Which of `steps` steps run every block, where that does not depend on the data
        (None: it does)."""
        return None

    def call(self, model, state: dict | None, reduce_sum: Callable, force: bool | None = None):
        """One model call: (output, stale buffers after it, new state). `model` is the call's
        parts (`parallel.cached.ModelParts`); `state` None at the first step (or zeros shaped
        as a computed step leaves it, which every cache reads as its initial state); `force` True or
        False takes that branch whatever the decision (a program with one branch, whose
        collectives are one kind of step's: for counting bytes)."""
        raise NotImplementedError


def check_threshold(cache: str, t, usual: str) -> None:
    """A data-dependent cache's threshold: a finite number > 0, or a one-line error."""
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
        raise ValueError(
            f"{cache} threshold={t!r}: must be a finite number > 0 ({usual}; larger skips more "
            f"steps)"
        )


def cache_options(cls) -> list:
    """A cache's options: its fields but those the pipeline sets (`internal`)."""
    return [f for f in fields(cls) if not f.metadata.get("internal")]


def cache_report(cache: StepCache, num_blocks: int, steps: int, computed_steps: int,
                 closest: float | None = None) -> dict:  # fmt: skip
    """A run's record of its cache: {"cache": description, "cache_computed_steps": steps that
    ran every block, "blocks_computed": the fraction of the denoiser's block calls that ran},
    and for a data-dependent cache "cache_closest_decision": how near (relative) the statistic
    of any of its decisions came to the threshold (`CLOSEST`; None: no decision taken)."""
    out = {
        "cache": cache.describe(),
        "cache_computed_steps": computed_steps,
        "blocks_computed": cache.blocks_computed(num_blocks, steps, computed_steps),
    }
    if closest is not None:
        out["cache_closest_decision"] = closest if math.isfinite(closest) else None
    return out


# The state's record of the decision taken nearest its threshold: min over the run's
# data-dependent decisions of |statistic / threshold - 1| (inf before the first). Float
# rounding moves a statistic by ~1e-7 (relative): a decision further than that from its
# threshold is the same on any machine and on any number of devices.
CLOSEST = "closest"


def zeros_like(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
