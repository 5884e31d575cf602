"""Denoisers that take turns over the steps: Wan 2.2's two experts, a high-noise transformer for
the steps whose timestep is at least `boundary_ratio` x num_train_timesteps and a low-noise one
for the rest, each with its own guidance scale (diffusers' WanPipeline with `boundary_ratio`,
`transformer_2` and `guidance_scale_2`). The experts share one architecture, so one denoiser
(and one compiled program per span) runs either: only the parameters differ.

The sampler's history runs on across a switch, as one scheduler does in diffusers; what a
parallel strategy keeps from step to step (stale activations, K/V buffers, a step cache's
residuals) is another network's once the expert changes, so each expert's span starts afresh:
its own warm-up, as a run of its own would."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import numpy as np


@dataclass(frozen=True)
class Experts:
    """Expert k runs steps [starts[k], starts[k + 1]) (the last to the end) with guidance
    `scales[k]`; the parameters of a denoising call are then a tuple, one per expert."""

    starts: tuple[int, ...]
    scales: tuple[float, ...]

    def __post_init__(self):
        starts = tuple(self.starts)
        if not starts or starts[0] != 0 or any(b <= a for a, b in pairwise(starts)):
            raise ValueError(f"expert starts={starts}: must rise strictly from step 0")
        if len(self.scales) != len(starts):
            raise ValueError(f"{len(self.scales)} guidance scales for {len(starts)} experts")
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "scales", tuple(float(s) for s in self.scales))

    def spans(self, steps: int) -> tuple[tuple[int, int], ...]:
        """Each expert's [first step, stop) in a run of `steps` steps."""
        if self.starts[-1] >= steps:
            raise ValueError(f"expert starts={self.starts} for {steps} steps: each needs a step")
        return tuple(pairwise((*self.starts, steps)))


def by_expert(params, guidance_scale: float, experts: Experts | None, steps: int) -> list:
    """[(parameters, guidance scale, (first step, stop))] of each expert in turn; without
    `experts`, the one denoiser over every step."""
    if experts is None:
        return [(params, guidance_scale, (0, steps))]
    return list(zip(params, experts.scales, experts.spans(steps), strict=True))


def two_experts(timesteps, boundary_ratio: float, train_steps: int, scales, cache=None):
    """(the experts that run, by index, `Experts` over them) for a run of these timesteps, two
    experts given with guidance `scales` (loop scales): the high-noise one (0) while the
    timestep is >= boundary_ratio x `train_steps`, then the low-noise one (1), as WanPipeline;
    an expert with no step does not run. A step `cache` across both is refused."""
    n = len(timesteps)
    k = switch_step(timesteps, boundary_ratio, train_steps)
    which = (0,) if k == n else (1,) if k == 0 else (0, 1)
    if len(which) == 2 and cache is not None:
        raise ValueError(
            f"cache {cache.name!r} with two experts: not defined here; what a cache keeps (a "
            f"residual, an output) is one network's, and the experts switch at step {k + 1} of "
            f"{n}; run without a cache"
        )
    starts = (0,) if len(which) == 1 else (0, k)
    return which, Experts(starts, tuple(float(scales[i]) for i in which))


def switch_step(timesteps, boundary_ratio: float, train_steps: int) -> int:
    """The first step of the low-noise expert: the steps before it have timesteps >=
    `boundary_ratio` x `train_steps` (diffusers' WanPipeline)."""
    t = np.asarray(timesteps, np.float64)
    return int((t >= boundary_ratio * train_steps).sum())


def check_boundary_ratio(ratio) -> float:
    """A boundary ratio in (0, 1) (ValueError otherwise)."""
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, int | float)
        or not (math.isfinite(ratio) and 0 < ratio < 1)
    ):
        raise ValueError(
            f"boundary_ratio={ratio!r}: the fraction of the training timesteps above which the "
            f"high-noise expert runs; give a number in (0, 1), as Wan 2.2's 0.875"
        )
    return float(ratio)
