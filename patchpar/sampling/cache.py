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

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

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
        _check_threshold("fbcache", self.threshold, "diffusers' default 0.05")

    def blocks_computed(self, num_blocks: int, steps: int, computed_steps: int) -> float:
        return (steps + computed_steps * (num_blocks - 1)) / (steps * num_blocks)

    def call(self, model, state, reduce_sum, force=None):
        last, stale, new, carry = first_block_step(
            self, state, model.head, model.tail, model.skip, reduce_sum, model.quiet, force
        )
        return model.epilogue(last, carry), stale, new


@dataclass(frozen=True)
class TaylorSeer(StepCache):
    interval: int = 5
    """After the warm-up, one step in `interval` runs the denoiser; the others predict its
    output (diffusers' cache_interval)."""
    warmup: int = 3
    """The first steps all run the denoiser (diffusers' disable_cache_before_step)."""
    order: int = 1
    """The Taylor expansion's highest order (diffusers' max_order)."""
    stop: int | None = None
    """From this step on every step runs again (diffusers' disable_cache_after_step; None:
    never)."""

    name: ClassVar[str] = "taylorseer"
    summary: ClassVar[str] = "it predicts the denoiser's output from its last computed steps"

    def __post_init__(self):
        # warmup >= 1: the first step computes (a prediction needs a computed step before it)
        for key, low in (("interval", 1), ("warmup", 1), ("order", 0)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"taylorseer {key}={v!r}: must be an integer >= {low}")
        st = self.stop
        if st is not None and (isinstance(st, bool) or not isinstance(st, int) or st < 1):
            raise ValueError(f"taylorseer stop={st!r}: must be an integer >= 1 (or unset)")

    def validate(self, denoiser, steps: int) -> None:
        """Refused: options under which no step is predicted. Step `warmup` is the first that
        may be: it is, unless interval is 1 or the run (or `stop`) ends before it. A stop of
        `steps` or more is allowed (caching never stops, as unset), and so are an interval and
        an order beyond what the run reaches (as the defaults are on a short run)."""
        super().validate(denoiser, steps)
        w = self.warmup
        if self.interval == 1:
            raise self._inert(
                steps,
                "predicted",
                "interval=1 computes every step after the warm-up",
                "interval >= 2",
            )
        if w >= steps:
            raise self._inert(
                steps, "predicted", f"warmup={w} covers every step", f"warmup <= {steps - 1}"
            )
        if self.stop is not None and self.stop <= w:
            raise self._inert(
                steps,
                "predicted",
                f"stop={self.stop} computes every step from it on, and "
                f"step {w} (warmup={w}) is the first that could be predicted",
                f"stop >= {w + 1} (or unset: never)",
            )

    def idle_options(self, steps: int) -> list[str]:
        if self.stop is None or self.stop < steps:
            return []
        return [
            f"cache stop={self.stop} has no effect with {steps} steps: the last step is "
            f"{steps - 1}, so caching never stops (as unset); use stop <= {steps - 1}"
        ]

    def computes(self, step):
        """Whether step `step` (from 0) runs the denoiser: diffusers' schedule."""
        after = (step - self.warmup - 1) % self.interval == 0
        keep = step < self.warmup
        if self.stop is not None:
            keep = jnp.logical_or(keep, step >= self.stop)
        return jnp.logical_or(keep, after)

    def blocks_computed(self, num_blocks: int, steps: int, computed_steps: int) -> float:
        return computed_steps / steps

    def schedule(self, steps: int) -> list[bool]:
        stop = steps if self.stop is None else self.stop
        return [s < self.warmup or s >= stop or (s - self.warmup - 1) % self.interval == 0
                for s in range(steps)]  # fmt: skip

    def call(self, model, state, reduce_sum, force=None):
        with model.quiet():  # a shape trace: its site calls are not the program's
            like = jax.eval_shape(model.whole)
        if state is None:
            state = {
                "factors": jnp.zeros((self.order + 1, *like[0].shape), jnp.float32),
                "orders": jnp.zeros((), jnp.int32),  # factors held (0: none yet)
                "last": jnp.zeros((), jnp.int32),  # the step they were taken at
                "step": jnp.zeros((), jnp.int32),
                "computed": jnp.zeros((), jnp.int32),
            }
        step = state["step"]

        def computed():
            out, stale = model.whole()
            return out, stale, _taylor_update(state, out.astype(jnp.float32), step)

        def predicted():
            out = _taylor_predict(state, step).astype(like[0].dtype)
            return out, model.incoming(), (state["factors"], state["orders"], state["last"])

        compute = self.computes(step)
        if force is None:
            out, stale, (factors, orders, last) = lax.cond(compute, computed, predicted)
        else:
            out, stale, (factors, orders, last) = (computed if force else predicted)()
            compute = jnp.asarray(force)
        new = {
            "factors": factors,
            "orders": orders,
            "last": last,
            "step": step + 1,
            "computed": state["computed"] + compute.astype(jnp.int32),
        }
        return out, stale, new


def _taylor_update(state, out, step):
    """The factors after a computed step: the output, then divided differences against the
    last computed step's factors, as many orders as those held allow."""
    old, held = state["factors"], state["orders"]
    delta = jnp.maximum(step - state["last"], 1).astype(jnp.float32)
    new = [out]
    for j in range(old.shape[0] - 1):
        new.append(jnp.where(held > j, (new[j] - old[j]) / delta, 0.0))
    orders = jnp.minimum(held + 1, old.shape[0])
    return jnp.stack(new), orders, step


def _taylor_predict(state, step):
    """The output at `step` from the factors taken at step `last`: sum over the orders held
    of factor_k (step - last)^k / k!."""
    factors, held = state["factors"], state["orders"]
    offset = (step - state["last"]).astype(jnp.float32)
    out = jnp.zeros(factors.shape[1:], jnp.float32)
    for k in range(factors.shape[0]):
        term = factors[k] * (offset**k / math.factorial(k))
        out = out + jnp.where(held > k, term, 0.0)
    return out


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
                "feature": _zeros(like[2]),
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
        _check_threshold(
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
            return last, stale, _sub(last, h0)

        with model.quiet():  # a shape trace: its site calls are not the program's
            like = jax.eval_shape(computed)
        if state is None:
            state = {
                "previous": jnp.zeros(m.shape, jnp.float32),
                "residual": _zeros(like[2]),
                "distance": jnp.zeros((), jnp.float32),
                "step": jnp.zeros((), jnp.int32),
                "computed": jnp.zeros((), jnp.int32),
                CLOSEST: jnp.full((), jnp.inf, jnp.float32),
            }
        step, prev = state["step"], state["previous"]
        sums = reduce_sum(jnp.stack([jnp.sum(jnp.abs(m - prev)), jnp.sum(jnp.abs(prev))]))
        rel = sums[0] / jnp.where(sums[1] > 0, sums[1], 1.0)
        grown = state["distance"] + jnp.polyval(
            jnp.asarray(model.teacache_coefficients, jnp.float32), rel
        )
        edge = step == 0
        if self.steps is not None:
            edge = jnp.logical_or(edge, step == self.steps - 1)
        compute = jnp.logical_or(edge, grown >= self.threshold)
        taken = jnp.logical_and(jnp.logical_not(edge), force is None)  # decided by the data
        closest = _closest(state, step == 0, grown, self.threshold, taken)

        def skipped():
            return _add(h0, state["residual"]), model.incoming(), state["residual"]

        if force is None:
            last, stale, residual = lax.cond(compute, computed, _cast(skipped, like))
        else:
            last, stale, residual = (computed if force else _cast(skipped, like))()
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


def _check_threshold(cache: str, t, usual: str) -> None:
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


def _closest(state: dict, first, statistic, threshold: float, taken) -> jax.Array:
    """The state's `CLOSEST` after a decision on `statistic` (counted where `taken`); `first`:
    the run's first step (whatever the state holds then is not a record: the engine may start
    a state as zeros)."""
    near = jnp.abs(statistic / threshold - 1.0).astype(jnp.float32)
    near = jnp.where(jnp.isnan(near), 0.0, near)  # a 0/0 statistic: no margin at all
    before = jnp.where(first, jnp.inf, state[CLOSEST])
    return jnp.where(taken, jnp.minimum(before, near), before)


def _sub(a, b):  # per part of `hs`; a part a block no longer returns (SD3's text) is None
    return tuple(None if x is None else x - y for x, y in zip(a, b, strict=True))


def _add(a, r):
    return tuple(None if y is None else x + y for x, y in zip(a, r, strict=True))


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def first_block_step(
    cache: FirstBlockCache,
    state: dict | None,
    head: Callable,
    tail: Callable,
    skip: Callable,
    reduce_sum: Callable = lambda x: x,
    quiet: Callable = contextlib.nullcontext,
    force: bool | None = None,
):
    """One step of the first-block cache.

    head() -> (hs before the first block, hs after it, carry); tail(hs, carry) -> (hs after
    the last block, extra); skip(carry) -> extra (what `tail` would give, from what is
    carried: the stale buffers); reduce_sum: the sum over every device (identity on one);
    quiet(): a context for shape traces (their site calls are not the program's); force: as
    `StepCache.call`. `state` None: the first step. -> (hs after the last block, extra, new
    state, carry)."""
    h0, h1, carry = head()

    def computed():
        last, extra = tail(h1, carry)
        return last, extra, _sub(last, h1), h1[0] - h0[0]

    with quiet():
        like = jax.eval_shape(computed)
    if state is None:  # shaped as a computed step leaves it
        state = {
            "residual": _zeros(like[3]),
            "tail": _zeros(like[2]),
            "valid": jnp.zeros((), jnp.int32),
            "computed": jnp.zeros((), jnp.int32),
            CLOSEST: jnp.full((), jnp.inf, jnp.float32),
        }
    r = (h1[0] - h0[0]).astype(jnp.float32)
    prev = state["residual"].astype(jnp.float32)
    sums = reduce_sum(jnp.stack([jnp.sum(jnp.abs(r - prev)), jnp.sum(jnp.abs(prev))]))
    compute = jnp.logical_or(state["valid"] == 0, sums[0] / sums[1] > cache.threshold)
    taken = jnp.logical_and(state["valid"] != 0, force is None)  # decided by the data
    closest = _closest(state, state["valid"] == 0, sums[0] / sums[1], cache.threshold, taken)

    def skipped():
        return _add(h1, state["tail"]), skip(carry), state["tail"], state["residual"]

    if force is None:
        last, extra, tail_res, residual = lax.cond(compute, computed, _cast(skipped, like))
    else:
        last, extra, tail_res, residual = (computed if force else _cast(skipped, like))()
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


def _cast(fn, like):
    """fn with its outputs cast to the dtypes of `like` (the skip branch adds float residuals
    as the computed one does; a cond needs both alike)."""

    def wrapped():
        out = fn()
        return jax.tree.map(lambda a, s: a.astype(s.dtype), out, like)

    return wrapped
