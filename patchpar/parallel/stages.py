"""A DiT's blocks laid out in pipeline stages (PipeFusion's, `patchpar.parallel.pipeline`):
each segment of identical blocks split over S stages as evenly as it goes (the first stages one
block more, the others padded with a skipped block), stacked in device order and placed so
that each device holds its stages' blocks."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from patchpar.parallel.mesh import PATCH
from patchpar.parallel.sites.common import bits


def layer_counts(layers: int, stages: int) -> list[int]:
    """Blocks per stage: as even as they go, the first stages one more."""
    q, r = divmod(layers, stages)
    return [q + (s < r) for s in range(stages)]


def _stack_segment(blocks: list, stages: int, reverse: bool):
    """One segment's blocks stacked in device order (S x per, ...), zero blocks padding short
    stages, and (S x per,) bool: a real block."""
    counts = layer_counts(len(blocks), stages)
    per, starts = max(counts), np.cumsum([0] + counts[:-1])
    xp = np if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(blocks)) else jnp
    pad = jax.tree.map(xp.zeros_like, blocks[0]) if min(counts) < per else None
    order, real = [], []
    for d in range(stages):
        t = stages - 1 - d if reverse else d  # the stage device d runs
        order += [blocks[starts[t] + j] if j < counts[t] else pad for j in range(per)]
        real += [j < counts[t] for j in range(per)]
    return jax.tree.map(lambda *ls: xp.stack(ls), *order), xp.asarray(real)


def stacked(stack, params, stages: int):
    """(outer parameters, per segment its blocks stacked in device order (S x per, ...),
    per segment (S x per,) bool: a real block); per = the most blocks of a stage."""
    segs = [
        _stack_segment(b, stages, k % 2 == 1) for k, b in enumerate(stack.segment_blocks(params))
    ]
    return stack.outer(params), tuple(b for b, _ in segs), tuple(r for _, r in segs)


class Staged(NamedTuple):
    """A DiT's parameters laid out for the pipeline (`stacked`), placed once: the blocks
    sharded over `patch` (each device holds its stages'), the rest on every device. Passed
    in place of the parameters, the phase programs take each device's blocks as they are;
    plain parameters are stacked inside the program instead (every device then holds them
    all, and the stacked copy too)."""

    outer: dict
    blocks: tuple
    real: tuple


def staged(stack, params, plan) -> Staged:
    """`params` stacked and placed on `plan`'s mesh (abstract parameters give abstract,
    sharded shapes: for lowering without weights)."""
    mesh = plan.mesh()
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params)):
        parts = jax.eval_shape(lambda p: stacked(stack, p, plan.patch), params)

        def put(spec):
            sharding = NamedSharding(mesh, spec)
            return lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    else:
        parts = stacked(stack, jax.tree.map(np.asarray, params), plan.patch)

        def put(spec):
            sharding = NamedSharding(mesh, spec)

            def place(a):  # every process places its own devices' parts
                host = np.asarray(a)
                return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

            return place

    outer, blocks, real = parts
    return Staged(
        jax.tree.map(put(P()), outer),
        jax.tree.map(put(P(PATCH)), blocks),
        jax.tree.map(put(P(PATCH)), real),
    )


def block_bytes_per_device(stack, params, stages: int) -> int:
    """Parameter bytes one device holds: the outer parameters whole, its (padded) share of
    each segment's blocks."""
    size = lambda tree: sum(  # noqa: E731 (int4: half a byte)
        math.ceil(math.prod(a.shape) * bits(a.dtype) / 8) for a in jax.tree.leaves(tree)
    )
    share = sum(
        max(layer_counts(len(b), stages)) * size(b[0]) for b in stack.segment_blocks(params)
    )
    return size(stack.outer(params)) + share
