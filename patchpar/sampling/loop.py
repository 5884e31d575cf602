"""The denoising loop: steps [start, stop) of one sampler as a single `lax.fori_loop`, so a
phase compiles once whatever its length. The model function threads its own state (stale
buffers of the parallel strategies; `()` on one device) next to the solver's history.

    model_fn(x_in, t, i, model_state) -> (model_output, model_state)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from patchpar.sampling.schedulers import Sampler, Schedule

ModelFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def run_steps(
    model_fn: ModelFn,
    sampler: Sampler,
    schedule: Schedule,
    x: jax.Array,  # (B, H, W, C) latent at step `start`
    solver_carry,
    model_state,
    start: int,
    stop: int,
    watch: bool = False,
):
    """Returns (x at step `stop`, solver_carry, model_state). With `watch` (a diagnostic run,
    not a timed one: the check is a reduction over the whole latent, a collective when x is
    sharded), also the first step whose x came out with a NaN or Inf (int32, -1: none)."""

    def body(i, loop):
        x, carry, state = loop[:3]
        x_in = sampler.scale_input(schedule, i, x)
        out, state = model_fn(x_in, schedule.timesteps[i], i, state)
        x, carry = sampler.step(schedule, i, x, out, carry)
        if not watch:
            return x, carry, state
        first = loop[3]
        bad = jnp.logical_not(jnp.all(jnp.isfinite(x)))
        return x, carry, state, jnp.where((first < 0) & bad, i, first)

    init = (x, solver_carry, model_state) + ((jnp.int32(-1),) if watch else ())
    return jax.lax.fori_loop(start, stop, body, init)


def guided(unet_output: jax.Array, guidance_scale: float) -> jax.Array:
    """Classifier-free guidance on a (2, B, ...) stack [unconditional, conditional]; (1, B, ...)
    passes through. -> (B, ...)"""
    if unet_output.shape[0] == 1:
        return unet_output[0]
    uncond, cond = unet_output[0], unet_output[1]
    return (uncond + guidance_scale * (cond - uncond).astype(jnp.float32)).astype(unet_output.dtype)
