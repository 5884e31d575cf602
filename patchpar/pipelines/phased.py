"""A pipeline's denoising run phase by phase (`Pipeline.denoise_phases`): announced, every
phase compiled before any runs (`denoise_logged`), and the watched replay that names the step
where a latent first held a NaN or Inf (`check_finite_latent`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from patchpar.parallel.mesh import to_local
from patchpar.pipelines.checks import NonFiniteError


def denoise_logged(pipe, cond, latents, sampler, steps, guidance_scale, plan, check_memory, log,
                   guidance_scale_2=None):  # fmt: skip
    """`pipe.denoise_with_state` phase by phase, announced: every phase compiled (and, with
    `check_memory`, checked to fit) before any runs, then each run in turn. -> (final latent,
    final state, seconds spent compiling every phase)."""
    programs, args = pipe.denoise_phases(
        cond, latents, sampler, steps, guidance_scale, plan, False, guidance_scale_2
    )
    compiled, x, loop, done = [], args[3], None, 0
    for phase, n, fn in programs:
        name = "denoising" if len(programs) == 1 else f"{phase.replace('warmup', 'warm-up')} phase"
        span = f"steps {done + 1}-{done + n} of {steps}"
        log(f"{name}: compiling ({span})")
        t0 = time.perf_counter()
        c = jax.jit(fn).lower(*args[:3], x, loop).compile()
        if check_memory:
            from patchpar.measure.cost import check_fits, memory_per_device

            what = "the denoising program" if len(programs) == 1 else f"the {name}'s program"
            check_fits(memory_per_device(c), what)
        compiled.append((name, span, c, time.perf_counter() - t0))
        x, loop = outputs_abstract(c)  # the next phase is lowered on what this returns
        done += n
    x, loop = args[3], None
    for name, span, c, compile_s in compiled:
        log(f"{name}: running {span} (compiled in {compile_s:.1f} s)")
        x, loop = c(*args[:3], x, loop)
    final = to_local(x)
    check_finite_latent(pipe, final, cond, latents, sampler, steps, guidance_scale, plan,
                        guidance_scale_2)  # fmt: skip
    return final, loop[1], sum(c[3] for c in compiled)


def check_finite_latent(pipe, final, cond, latents, sampler, steps, guidance_scale, plan=None,
                        guidance_scale_2=None):  # fmt: skip
    """NonFiniteError when `pipe`'s final latent `final` holds NaN or Inf, naming the step and
    phase where it first did: the run is replayed phase by phase with the loop watched (a
    diagnostic program, run only then). Every process of a launched run calls it (the
    replay has collectives); they all see the same gathered latent. A plan with stand-in
    collectives (`comm=False`: timing alone, the images wrong by design) is not checked."""
    if plan is not None and not plan.comm:
        return
    if np.isfinite(np.asarray(to_local(final), np.float32)).all():
        return
    programs, args = pipe.denoise_phases(
        cond, latents, sampler, steps, guidance_scale, plan, True, guidance_scale_2
    )
    where, x, loop, done = "only in the timed run", args[3], None, 0
    for phase, n, fn in programs:
        x, loop, first = fn(*args[:3], x, loop)
        first = int(first)
        in_phase = f"{phase.replace('warmup', 'warm-up')} phase; " if len(programs) > 1 else ""
        if first >= 0:
            where = f"first after step {first + 1} of {steps} ({in_phase}"
            break
        if not np.isfinite(np.asarray(to_local(x), np.float32)).all():
            where = f"first in steps {done + 1}-{done + n} of {steps} ({in_phase}"
            break
        done += n
    else:
        where += " ("
    label = "single" if plan is None else plan.strategy.name
    devices = 1 if plan is None else plan.devices
    scales = f"{guidance_scale}" + ("" if guidance_scale_2 is None else f" / {guidance_scale_2}")
    raise NonFiniteError(
        f"NaN or Inf in the latent, {where}{label} on {devices} device(s), {sampler}, "
        f"guidance {scales}, {jnp.dtype(pipe.unet.module.dtype).name}): no image of "
        f"it is a result; an overflow in bfloat16 may fit in float32, else the weights, "
        f"inputs or guidance are at fault"
    )


def outputs_abstract(compiled):
    """A compiled program's outputs as shapes, dtypes and shardings (the next phase's inputs,
    to lower it before the first has run)."""
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        compiled.out_info,
        compiled.output_shardings,
    )
