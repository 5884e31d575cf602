"""Every step on one device (`single`, and a step cache without devices): the denoiser on every
guidance half at once, the whole loop as one program, or as the phase programs' signature."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from patchpar.models.family import Denoiser
from patchpar.parallel.cached import cached_call
from patchpar.parallel.sites import STALE
from patchpar.sampling.cache import CACHE
from patchpar.sampling.experts import by_expert
from patchpar.sampling.guidance import Conditioning, call_on_stack
from patchpar.sampling.loop import guided, run_steps


def unet_on_stack(
    unet: Denoiser, params, x: jax.Array, t: jax.Array, cond: Conditioning
) -> jax.Array:
    """The denoiser on every guidance half at once: x (B, h, W, C) -> (G, B, h, W, C), the
    sampler's model output (`prediction`: a learned-sigma DiT's first half)."""
    return unet.prediction(call_on_stack(lambda *a, **k: unet(params, *a, **k), x, t, cond))


@partial(jax.jit, static_argnums=(0, 1, 2, 7, 8))
def denoise_single(unet, smp, cache, params, cond, schedule, x, guidance_scale, experts=None):
    """All steps on one device (with `experts`, each expert's in turn: `params` a tuple of
    theirs); returns (final latent, state: empty, or the step cache's)."""
    n, carry = schedule.timesteps.shape[0], smp.init_carry(x)
    for p, gs, (start, stop) in by_expert(params, guidance_scale, experts, n):
        model_fn, state = single_model_fn(unet, cache, p, cond, gs, x)
        x, carry, state = run_steps(model_fn, smp, schedule, x, carry, state, start, stop)
    return x, ({} if cache is None else {CACHE: state})


def single_model_fn(unet, cache, params, cond, guidance_scale, x):
    """(the run loop's model_fn on one device, its initial state) without or with a step
    cache (`sampling.cache`, the engine's `cached_call` without devices)."""
    if cache is None:

        def model_fn(x_in, t, i, state):
            return guided(unet_on_stack(unet, params, x_in, t, cond), guidance_scale), state

        return model_fn, ()

    def model_fn(x_in, t, i, state):
        out, _, state = cached_call(cache, unet.module, {"params": params}, [STALE],
                                    lambda m: {}, x_in, t, cond, state, lambda v: v)  # fmt: skip
        return guided(unet.prediction(out), guidance_scale), state

    t0 = jnp.zeros((), jnp.float32)
    shapes = jax.eval_shape(lambda: model_fn(x, t0, 0, None)[1])
    return model_fn, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


@partial(
    jax.jit,
    static_argnums=(0, 1, 2, 3, 9),
    static_argnames=("guidance_scale", "watch", "span", "expert", "restart"),
)
def single_phase(
    unet, smp, cache, _phase, params, cond, schedule, x, loop, guidance_scale, watch=False,
    span=None, expert=None, restart=False,
):  # fmt: skip
    """`denoise_single` with the phase programs' signature: (x, loop) -> (x, loop), loop =
    (solver carry, state); steps `span` (default all) of `expert` (`params` then the experts'
    tuple), the sampler's history taken from `loop` unless it is None (each call starts its
    state: one device has one phase per expert, so `restart` changes nothing); `watch`: also
    the first step that left a NaN or Inf in x (-1: none)."""
    del restart
    start, stop = (0, schedule.timesteps.shape[0]) if span is None else span
    params = params if expert is None else params[expert]
    model_fn, state = single_model_fn(unet, cache, params, cond, guidance_scale, x)
    carry = smp.init_carry(x) if loop is None else loop[0]
    x, carry, state, *first = run_steps(model_fn, smp, schedule, x, carry, state, start, stop,
                                        watch)  # fmt: skip
    return (x, (carry, {} if cache is None else {CACHE: state}), *first)
