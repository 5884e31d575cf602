"""The device mesh. Axis names are defined here once and used by name everywhere else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

CFG = "cfg"  # the two classifier-free-guidance halves (size 1 or 2)
PATCH = "patch"  # row patches of one image


def make_mesh(devices: int, cfg: int = 1) -> Mesh:
    """A (cfg, patch) mesh over the first `devices` devices; patch = devices / cfg."""
    have = jax.device_count()
    if cfg not in (1, 2):
        raise ValueError(
            f"cfg={cfg!r}: must be 1 (both CFG halves on every device) or 2 (split across devices)"
        )
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r}: must be a positive integer")
    if devices > have:
        raise ValueError(
            f"devices={devices} asked for, but only {have} present (on CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts)"
        )
    if devices % cfg:
        raise ValueError(
            f"devices={devices} is not divisible by cfg={cfg}; use an even device count with cfg=2"
        )
    grid = np.asarray(jax.devices()[:devices]).reshape(cfg, devices // cfg)
    # Auto axes: shard_map places unsharded inputs by its in_specs.
    return Mesh(grid, (CFG, PATCH), axis_types=(AxisType.Auto, AxisType.Auto))


def to_local(x: jax.Array) -> jax.Array:
    """`x` whole on this process's default device. An array spread over devices of several
    processes (a multi-process mesh, docs/design.md §1) is all-gathered first; every process
    must call this for the same array."""
    if x.is_fully_addressable:
        return x
    from jax.experimental import multihost_utils

    return jnp.asarray(multihost_utils.process_allgather(x, tiled=True))
