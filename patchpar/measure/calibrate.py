"""How fast each device runs a patch (STADI's spatial half; docs/design.md "Uneven patches"):
the denoiser's step on one patch's slab, timed on each device while every other device times
its own (each compiles first; every timed step starts at a barrier), so that a device slowed
by a shared core, a background job or slower silicon is seen as it is. A device's patch weight
is its speed relative to the fastest, t_fastest / t.

The program timed is the denoiser on the slab alone (`single` on the patch's rows), not the
strategy's per-device program: the same program on every device, so the ratios of the times
are the ratios of the devices' speeds, whatever a strategy adds to each step."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def patch_seconds(
    unet, params, slab_hw: tuple[int, int], device, repeats: int = 5, together=None
) -> float:
    """Median seconds of one denoiser step (both guidance halves: the denoiser's own
    `guidance_halves`) on a slab of `slab_hw` latent rows x columns, on `device` (`params` put
    there), after one untimed call that compiles it. `together()` (optional) is called before
    each timed step, outside the timing: a barrier, so that every device's steps run at once."""
    from patchpar.parallel.engine import Plan, abstract_inputs, make_step
    from patchpar.parallel.mesh import device_mesh
    from patchpar.parallel.strategies import make_strategy

    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    x_abs, _, cond_abs = abstract_inputs(unet, slab_hw, 1)
    rng = np.random.RandomState(0)

    def put(s):
        return jax.device_put(rng.standard_normal(s.shape).astype(s.dtype), device)

    x, cond = put(x_abs), jax.tree.map(put, cond_abs)
    t = jax.device_put(jnp.asarray(500.0, jnp.float32), device)
    params = jax.device_put(params, device)
    plan = Plan(make_strategy("single"), 1)
    step = jax.jit(make_step(unet, plan, "warmup", "row", 5.0, device_mesh(device)))
    jax.block_until_ready(step(params, x, t, cond, None))
    times = []
    for _ in range(repeats):
        if together is not None:
            together()
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x, t, cond, None))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def devices_seconds(unet, params, slab_hw: tuple[int, int], devices: int, repeats: int = 5):
    """Each of the first `devices` devices' `patch_seconds`, in device order: in a
    multi-process run (one device per process) every process times its own at the same time
    and the times are gathered; in one process, the devices one after the other."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if jax.process_count() != devices or jax.local_device_count() != 1:
            raise ValueError(
                f"calibrating {devices} devices over {jax.process_count()} processes with "
                f"{jax.local_device_count()} device(s) each: give one device per process"
            )

        def together():  # every process's timed steps at once (its compile done apart)
            multihost_utils.sync_global_devices("patchpar calibrate: step")

        mine = jax.local_devices()[0]
        own = patch_seconds(unet, params, slab_hw, mine, repeats, together)
        got = multihost_utils.process_allgather(np.asarray([mine.id, own], np.float64))
        by_id = {int(i): float(s) for i, s in np.asarray(got).reshape(-1, 2)}
        return [by_id[d.id] for d in jax.devices()[:devices]]  # the mesh's (patch) order
    if devices > jax.local_device_count():
        raise ValueError(
            f"devices={devices}: only {jax.local_device_count()} present in this process"
        )
    return [patch_seconds(unet, params, slab_hw, d, repeats) for d in jax.devices()[:devices]]


def speed_weights(seconds) -> tuple[float, ...]:
    """Patch weights from the devices' seconds per step: each device's speed relative to the
    fastest (the fastest 1), to 3 decimals."""
    fastest = min(seconds)
    return tuple(max(0.001, round(fastest / s, 3)) for s in seconds)
