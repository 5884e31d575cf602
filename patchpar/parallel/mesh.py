"""The device mesh. Axis names are defined here once and used by name everywhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

DATA = "data"  # images of a batch (data parallel)
CFG = "cfg"  # the two classifier-free-guidance halves (size 1 or 2)
PATCH = "patch"  # row patches of one image
MODEL = "model"  # tensor parallel: the weights of a layer split across devices
AXES = (DATA, CFG, PATCH, MODEL)  # outermost first: device id = ((d*cfg + c)*patch + p)*model + m
# what a device carries from step to step and from phase to phase (stale buffers, a pipeline's
# patches): leading (data, cfg, patch, model) device axes
STATE_SPEC = P(*AXES)


def divisors(n: int) -> list[int]:
    """The degrees that split n evenly (for error messages: what would fit)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_shape(devices: int, cfg: int = 1, data: int = 1, model: int = 1) -> dict[str, int]:
    """{axis: degree} for `devices` split as data x cfg x patch x model; ValueError naming
    every degree and what would fit."""
    for name, value in (("devices", devices), ("data", data), ("model", model)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
    if cfg not in (1, 2):
        raise ValueError(
            f"cfg={cfg!r}: must be 1 (both CFG halves on every device) or 2 (split across devices)"
        )
    if devices % cfg:
        raise ValueError(
            f"devices={devices} is not divisible by cfg={cfg}; use an even device count with cfg=2"
        )
    if devices % (data * cfg):
        fits = [d for d in range(1, devices // cfg + 1) if devices % (d * cfg) == 0]
        raise ValueError(
            f"devices={devices} is not divisible by data={data} x cfg={cfg} = {data * cfg}: "
            f"patch = devices / (data x cfg) must be a whole number; with cfg={cfg}, data can be "
            f"one of {fits}"
        )
    rest = devices // (data * cfg)
    if rest % model:
        fits = divisors(rest)
        raise ValueError(
            f"model={model} does not divide the {rest} devices left by devices={devices} / "
            f"(data={data} x cfg={cfg}): patch x model must be {rest}; model can be one of {fits}"
        )
    return {DATA: data, CFG: cfg, PATCH: rest // model, MODEL: model}


def make_mesh(devices: int, cfg: int = 1, data: int = 1, model: int = 1) -> Mesh:
    """A (data, cfg, patch, model) mesh over the first `devices` devices; patch = devices /
    (data x cfg x model)."""
    shape = mesh_shape(devices, cfg, data, model)
    have = jax.device_count()
    if devices > have:
        raise ValueError(
            f"devices={devices} asked for, but only {have} present (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts)"
        )
    grid = np.asarray(jax.devices()[:devices]).reshape(tuple(shape[a] for a in AXES))
    # Auto axes: shard_map places unsharded inputs by its in_specs.
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def device_mesh(device) -> Mesh:
    """A (data, cfg, patch, model) mesh of the one `device` (in a multi-process run: this
    process's own, `jax.local_devices()`; a program on it runs there alone)."""
    grid = np.asarray([device]).reshape((1,) * len(AXES))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def to_local(x: jax.Array) -> jax.Array:
    """`x` whole on this process's default device. An array spread over devices of several
    processes (a multi-process mesh, docs/design.md §1) is all-gathered first; every process
    must call this for the same array."""
    if x.is_fully_addressable:
        return x
    from jax.experimental import multihost_utils

    return jnp.asarray(multihost_utils.process_allgather(x, tiled=True))
