"""The first-block caches: `fbcache` (a threshold on the first block's residual) and
`teacache` (a threshold on a rescaled change of its modulated input)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.sampling.cache.base import (
    CLOSEST,
    StepCache,
    check_threshold,
    zeros_like,
)


@dataclass(frozen=True)
class FirstBlockCache(StepCache):
    threshold: float = 0.05
    """Skip the other blocks while the first block's residual changed by at most this
    (relative mean absolute change since the last computed step); diffusers' default 0.05."""

    name: ClassVar[str] = "fbcache"
    summary: ClassVar[str] = "it skips a transformer's blocks after the first"
    min_steps: ClassVar[int] = 2
    min_steps_why: ClassVar[str] = (
        "the first step runs every block (the residual later steps compare with)"
    )

    def __post_init__(self):
        check_threshold("fbcache", self.threshold, "diffusers' default 0.05")

    def blocks_computed(self, num_blocks: int, steps: int, computed_steps: int) -> float:
        return (steps + computed_steps * (num_blocks - 1)) / (steps * num_blocks)

    def call(self, model, state, reduce_sum, force=None):
        last, stale, new, carry = first_block_step(
            self,
            state,
            model.head,
            model.tail,
            model.skip,
            reduce_sum,
            model.quiet,
            force,
            getattr(model, "own", lambda a: a),
        )
        return model.epilogue(last, carry), stale, new


@dataclass(frozen=True)
class TeaCache(StepCache):
    threshold: float = 0.25
    """Skip every block while the accumulated rescaled change of the first block's modulated
    input stays under this (TeaCache's rel_l1_thresh; for FLUX.1 0.25, 0.4, 0.6, 0.8 are its
    1.5x, 1.8x, 2.0x, 2.25x settings)."""
    steps: int | None = field(default=None, metadata={"internal": True})
    """The run's steps (bound by the pipeline: the last step always computes)."""

    name: ClassVar[str] = "teacache"
    summary: ClassVar[str] = (
        "it skips every block while the first block's modulated input barely changes, "
        "rescaled by a polynomial fitted on the family's trajectories: TeaCache's published "
        "one for FLUX.1, patchpar's own fit (the trained fmnist-dit) for PixArt"
    )
    min_steps: ClassVar[int] = 3
    min_steps_why: ClassVar[str] = "the first and the last step always run every block"

    def __post_init__(self):
        check_threshold(
            "teacache",
            self.threshold,
            "TeaCache's FLUX.1 settings 0.25 to 0.8; PixArt, with patchpar's own fit: 0.01 to 0.02",
        )

    def bind(self, steps: int) -> TeaCache:
        return replace(self, steps=steps)

    def blocks_computed(self, num_blocks: int, steps: int, computed_steps: int) -> float:
        return computed_steps / steps

    def call(self, model, state, reduce_sum, force=None):
        h0, carry = model.prologue()
        m = model.modulated(h0, carry).astype(jnp.float32)

        def computed():
            last, stale = model.all_blocks(h0, carry)
            return last, stale, sub_parts(last, h0)

        with model.quiet():  # a shape trace: its site calls are not the program's
            like = jax.eval_shape(computed)
        if state is None:
            state = {
                "previous": jnp.zeros(m.shape, jnp.float32),
                "residual": zeros_like(like[2]),
                "distance": jnp.zeros((), jnp.float32),
                "step": jnp.zeros((), jnp.int32),
                "computed": jnp.zeros((), jnp.int32),
                CLOSEST: jnp.full((), jnp.inf, jnp.float32),
            }
        step, prev = state["step"], state["previous"]
        own = getattr(model, "own", lambda a: a)  # uneven patches: the image's values alone
        sums = reduce_sum(jnp.stack([jnp.sum(own(jnp.abs(m - prev))), jnp.sum(own(jnp.abs(prev)))]))
        rel = sums[0] / jnp.where(sums[1] > 0, sums[1], 1.0)
        grown = state["distance"] + jnp.polyval(
            jnp.asarray(model.teacache_coefficients, jnp.float32), rel
        )
        edge = step == 0
        if self.steps is not None:
            edge = jnp.logical_or(edge, step == self.steps - 1)
        compute = jnp.logical_or(edge, grown >= self.threshold)
        taken = jnp.logical_and(jnp.logical_not(edge), force is None)  # decided by the data
        closest = update_closest(state, step == 0, grown, self.threshold, taken)

        def skipped():
            return add_parts(h0, state["residual"]), model.incoming(), state["residual"]

        if force is None:
            last, stale, residual = lax.cond(compute, computed, cast_like(skipped, like))
        else:
            last, stale, residual = (computed if force else cast_like(skipped, like))()
            compute = jnp.logical_or(compute, True) if force else jnp.logical_and(compute, False)
        new = {
            "previous": m,
            "residual": residual,
            "distance": jnp.where(compute, 0.0, grown),
            "step": step + 1,
            "computed": state["computed"] + compute.astype(jnp.int32),
            CLOSEST: closest,
        }
        return model.epilogue(last, carry), stale, new


def update_closest(state: dict, first, statistic, threshold: float, taken) -> jax.Array:
    """The state's `CLOSEST` after a decision on `statistic` (counted where `taken`); `first`:
    the run's first step (whatever the state holds then is not a record: the engine may start
    a state as zeros)."""
    near = jnp.abs(statistic / threshold - 1.0).astype(jnp.float32)
    near = jnp.where(jnp.isnan(near), 0.0, near)  # a 0/0 statistic: no margin at all
    before = jnp.where(first, jnp.inf, state[CLOSEST])
    return jnp.where(taken, jnp.minimum(before, near), before)


def sub_parts(a, b):  # per part of `hs`; a part a block no longer returns (SD3's text) is None
    return tuple(None if x is None else x - y for x, y in zip(a, b, strict=True))


def add_parts(a, r):
    return tuple(None if y is None else x + y for x, y in zip(a, r, strict=True))


def first_block_step(
    cache: FirstBlockCache,
    state: dict | None,
    head: Callable,
    tail: Callable,
    skip: Callable,
    reduce_sum: Callable = lambda x: x,
    quiet: Callable = contextlib.nullcontext,
    force: bool | None = None,
    own: Callable = lambda a: a,
):
    """One step of the first-block cache.

    head() -> (hs before the first block, hs after it, carry); tail(hs, carry) -> (hs after
    the last block, extra); skip(carry) -> extra (what `tail` would give, from what is
    carried: the stale buffers); reduce_sum: the sum over every device (identity on one);
    quiet(): a context for shape traces (their site calls are not the program's); force: as
    `StepCache.call`; own(a): `a` with what is not this device's patch zeroed (uneven
    patches' padding). `state` None: the first step. -> (hs after the last block, extra, new
    state, carry)."""
    h0, h1, carry = head()

    def computed():
        last, extra = tail(h1, carry)
        return last, extra, sub_parts(last, h1), h1[0] - h0[0]

    with quiet():
        like = jax.eval_shape(computed)
    if state is None:  # shaped as a computed step leaves it
        state = {
            "residual": zeros_like(like[3]),
            "tail": zeros_like(like[2]),
            "valid": jnp.zeros((), jnp.int32),
            "computed": jnp.zeros((), jnp.int32),
            CLOSEST: jnp.full((), jnp.inf, jnp.float32),
        }
    r = (h1[0] - h0[0]).astype(jnp.float32)
    prev = state["residual"].astype(jnp.float32)
    sums = reduce_sum(jnp.stack([jnp.sum(own(jnp.abs(r - prev))), jnp.sum(own(jnp.abs(prev)))]))
    compute = jnp.logical_or(state["valid"] == 0, sums[0] / sums[1] > cache.threshold)
    taken = jnp.logical_and(state["valid"] != 0, force is None)  # decided by the data
    closest = update_closest(state, state["valid"] == 0, sums[0] / sums[1], cache.threshold, taken)

    def skipped():
        return add_parts(h1, state["tail"]), skip(carry), state["tail"], state["residual"]

    if force is None:
        last, extra, tail_res, residual = lax.cond(compute, computed, cast_like(skipped, like))
    else:
        last, extra, tail_res, residual = (computed if force else cast_like(skipped, like))()
        # the decision's sums stay in the program (their all-reduce is a step's bytes)
        compute = jnp.logical_or(compute, True) if force else jnp.logical_and(compute, False)
    new = {
        "residual": residual,
        "tail": tail_res,
        "valid": jnp.ones((), jnp.int32),
        "computed": state["computed"] + compute.astype(jnp.int32),
        CLOSEST: closest,
    }
    return last, extra, new, carry


def cast_like(fn, like):
    """fn with its outputs cast to the dtypes of `like` (the skip branch adds float residuals
    as the computed one does; a cond needs both alike)."""

    def wrapped():
        out = fn()
        return jax.tree.map(lambda a, s: a.astype(s.dtype), out, like)

    return wrapped
