"""`deepcache`: a UNet's deep features reused between full steps, its shallow branch run
every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.sampling.cache.base import (
    StepCache,
    zeros_like,
)


@dataclass(frozen=True)
class DeepCache(StepCache):
    interval: int = 3
    """One step in `interval` runs the whole UNet, the first included; the others reuse its
    deep features (DeepCache's cache_interval N, default 3)."""
    branch: int = 0
    """The shallow branch's depth: the first `branch` + 1 down blocks and the last `branch` + 1
    up blocks run every step (DeepCache's cache_branch_id at the granularity of a level's
    blocks; 0: its default, the shallowest)."""

    name: ClassVar[str] = "deepcache"
    summary: ClassVar[str] = (
        "it reuses a UNet's deep features between full steps, running only the shallow branch "
        "of down and up blocks around them"
    )

    def __post_init__(self):
        for key, low in (("interval", 1), ("branch", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"deepcache {key}={v!r}: must be an integer >= {low}")

    def validate(self, denoiser, steps: int) -> None:
        super().validate(denoiser, steps)
        levels = denoiser.module.levels
        if self.branch >= levels:
            raise ValueError(
                f"deepcache branch={self.branch}: this UNet has {levels} levels; the shallow "
                f"branch keeps branch + 1 of them and reuses the rest (at least the mid "
                f"block): use branch <= {levels - 1}"
            )
        if self.interval == 1:  # (one of `steps` or more is allowed: step 0 alone computes)
            raise self._inert(
                steps, "reused", "interval=1 runs the whole UNet at every step", "interval >= 2"
            )
        if steps < 2:
            raise self._inert(
                steps,
                "reused",
                "the first step runs the whole UNet (the features later steps reuse)",
                "at least 2 steps",
            )

    def computes(self, step):
        return step % self.interval == 0

    def schedule(self, steps: int) -> list[bool]:
        return [s % self.interval == 0 for s in range(steps)]

    def blocks_computed(self, num_blocks: int, steps: int, computed_steps: int) -> float:
        # block calls of a reused step: the branch's levels' down layers and the downsamplers
        # between them, and their up blocks (`UNet2DConditionModel.branch_bounds`)
        shallow = 3 * self.branch + 2
        return (computed_steps * num_blocks + (steps - computed_steps) * shallow) / (
            steps * num_blocks
        )

    def call(self, model, state, reduce_sum, force=None):
        n = model.num_blocks
        down, up = model.module.branch_bounds(self.branch)  # shallow: [0, down), [up, n)
        hs0, carry = model.prologue()
        shallow, carry = model.span(0, down, hs0, carry)

        def computed():
            deep, carry2 = model.span(down, up, shallow, carry)
            last, carry2 = model.span(up, n, deep, carry2)
            return (*model.close(last, carry2), deep[0])

        with model.quiet():  # a shape trace: its site calls are not the program's
            like = jax.eval_shape(computed)
        if state is None:
            state = {
                "feature": zeros_like(like[2]),
                "step": jnp.zeros((), jnp.int32),
                "computed": jnp.zeros((), jnp.int32),
            }
        step = state["step"]

        def reused():  # the deep part consumes as many skips as it adds: the shallow ones stay
            deep = (state["feature"], tuple(shallow[1]))
            last, carry2 = model.span(up, n, deep, carry)
            return (*model.close(last, carry2), state["feature"])

        compute = self.computes(step)
        if force is None:
            out, stale, feature = lax.cond(compute, computed, reused)
        else:
            out, stale, feature = (computed if force else reused)()
            compute = jnp.asarray(force)
        new = {
            "feature": feature,
            "step": step + 1,
            "computed": state["computed"] + compute.astype(jnp.int32),
        }
        return out, stale, new
