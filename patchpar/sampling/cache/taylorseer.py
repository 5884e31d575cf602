"""`taylorseer`: the blocks' output predicted from its finite differences of earlier
computed steps (a Taylor series in the step)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.sampling.cache.base import (
    StepCache,
)


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
