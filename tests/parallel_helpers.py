"""Micro models and inputs for the parallel-engine tests."""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from torch_refs import MICRO_UNETS

from patchpar.models.api import UNetFn
from patchpar.models.unet import UNet2DConditionModel, UNetConfig
from patchpar.pipelines.single import unet_on_stack
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.loop import guided

GUIDANCE = 5.0


@cache
def micro_unet(kind: str) -> tuple[UNetFn, dict]:
    fn = UNetFn(UNet2DConditionModel(UNetConfig.from_diffusers(MICRO_UNETS[kind])))
    params = fn.init(seed=1)
    # non-zero biases and norm shifts, so every site's arithmetic matters
    params = jax.tree.map(
        lambda p: (
            p + 0.05 * jnp.asarray(np.random.RandomState(p.size % 97).randn(*p.shape), p.dtype)
        ),
        params,
    )
    # Output scale like a trained model's noise prediction (|eps| of a few units at most), so the
    # final latents stay O(1) as in real runs and an absolute 1e-4 bound means what it says.
    params["conv_out"] = jax.tree.map(lambda p: 0.1 * p, params["conv_out"])
    # Host (NumPy) leaves: each program takes them as its own shardings need. A jax.Array on
    # one device would first be resharded leaf by leaf, one small compile per leaf and mesh.
    return fn, jax.tree.map(np.asarray, params)


def inputs(kind: str, batch: int = 2, hw: tuple[int, int] = (16, 16), seed: int = 0):
    """x (B, H, W, 4), t, and a CFG conditioning stack (2, B, ...)."""
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(batch, *hw, 4), jnp.float32)
    ctx = jnp.asarray(rng.randn(2, batch, 7, 16), jnp.float32)
    if kind == "sdxl":
        cond = Conditioning(
            ctx,
            {
                "text_embeds": jnp.asarray(rng.randn(2, batch, 8), jnp.float32),
                "time_ids": jnp.broadcast_to(
                    jnp.asarray([128.0, 128, 0, 0, 128, 128]), (2, batch, 6)
                ),
            },
        )
    else:
        cond = Conditioning(ctx)
    return x, jnp.asarray(500.0), cond


@partial(jax.jit, static_argnums=0)
def single_guided(unet, params, x, t, cond):
    """The reference: the guided output of one UNet call on one device (one compiled program;
    run op by op, a micro UNet call takes ~300 small compiles)."""
    return guided(unet_on_stack(unet, params, x, t, cond), GUIDANCE)


def denoise_cached(fn, params, x, cond, c, name, devices, cfg, gs, sampler, steps, **options):
    """(final latent, state) of `fn` from the unit latent `x` over `steps` steps of `sampler`
    on one device (`single`) or under strategy `name`, with step cache `c` (None: without)."""
    from patchpar.parallel.engine import Plan, denoise
    from patchpar.parallel.strategies import make_strategy
    from patchpar.pipelines.single import denoise_single
    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    smp = get_sampler(sampler)
    sched = smp.schedule(SchedulerConfig(), steps)
    x = x * sched.init_noise_sigma
    if name == "single":
        out, state = jax.jit(denoise_single, static_argnums=(0, 1, 2, 7))(
            fn, smp, c, params, cond, sched, x, gs
        )
    else:
        plan = Plan(make_strategy(name, **options), devices, cfg, cache=c)
        plan.validate(fn, x.shape[1:3], steps, gs)
        out, state = denoise(fn, plan, smp, params, cond, sched, x, gs)
    return np.asarray(out), state


def rounding(want) -> float:
    """How far an exact strategy's output may be from single's by float32 rounding alone (the
    same arithmetic in another order): 1e-4, or 1e-5 of the values' largest magnitude where
    that is more (the micro MMDiTs' latents reach ~150 after a few flow steps, where 1e-4 is
    5 ulps: a bound another machine's code generation could cross)."""
    return max(1e-4, 1e-5 * float(np.abs(np.asarray(want)).max()))


def reordered(want) -> float:
    """How far two programs of the same arithmetic (the same per-device operations, in
    programs of another mesh, batch split or weight layout) may be apart: a few float32 ulps
    of the values' scale (1e-6 of it; bit for bit where XLA compiles both alike)."""
    return 1e-6 * max(1.0, float(np.abs(np.asarray(want)).max()))


def compiled(f):
    """`f` as one compiled call per structure of its arguments, every leaf that is not a JAX
    array (a block index, a size a DiT's `aux` carries) fixed in the program: a reference
    written from a model's parts runs the same arithmetic as op by op, without a program
    compiled for each op."""
    programs = {}

    def call(*args):
        leaves, tree = jax.tree.flatten(args)
        static = tuple(None if isinstance(a, jax.Array) else a for a in leaves)
        if (tree, static) not in programs:

            def whole(arrays):
                it = iter(arrays)
                return f(*jax.tree.unflatten(tree, [next(it) if c is None else c for c in static]))

            programs[(tree, static)] = jax.jit(whole)
        return programs[(tree, static)]([a for a in leaves if isinstance(a, jax.Array)])

    return call
