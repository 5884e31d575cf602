"""FSDP's site: each parameterised layer gathers its weights, sharded at rest over `degree`
devices (boxed by `patchpar.parallel.rules.unplaced`), just before it runs, by one all-gather
of one flat buffer (PyTorch FSDP's flat parameter; site `fsdp`, scope `pp_fsdp`). The gathered
weights live only while the layer runs."""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from patchpar.parallel.sites.common import Site, bits, nbytes, note, stand_in

# The running layer's first input array, while its weights are gathered (`_after_input`)
_AFTER: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "patchpar_fsdp_after", default=None
)


@dataclass(frozen=True)
class FSDPGather(Site):
    kind = "fsdp"
    degree: int = 1  # devices each weight is sharded over at rest

    def layer(self, cls: type) -> type:
        """`cls` wrapped so that its parameters sharded at rest are all-gathered when it runs
        (Flax `map_variables`), once its input exists."""
        return cls if self.degree == 1 else _gathering(cls, self)

    def gather_weights(self, variables):
        """One layer's parameters, whole: its boxed shares (`nn.Partitioned`, names = the mesh
        axes of the one sharded dimension) go out flattened into one buffer and come back by
        one all-gather (one collective per layer, not one per tensor), then are cut and laid
        back; anything not boxed stays as it is."""
        is_box = lambda v: isinstance(v, nn.Partitioned)  # noqa: E731
        leaves, treedef = jax.tree.flatten(variables, is_leaf=is_box)
        groups: dict[tuple, list[tuple[int, int]]] = {}  # (dtype, axes) -> [(leaf, dim)]
        for i, leaf in enumerate(leaves):
            if is_box(leaf):
                (dim,) = [d for d, a in enumerate(leaf.names) if a is not None]
                groups.setdefault((leaf.value.dtype, leaf.names[dim]), []).append((i, dim))
        k = self.degree
        for (_, axes), members in groups.items():
            shares = [leaves[i].value for i, _ in members]
            # each share flattened after the input exists, so that no copy is made earlier
            flat = jnp.concatenate([_after_input(x.reshape(-1)) for x in shares])  # (L,)
            note(self, shape=flat.shape, itemsize=bits(flat.dtype) / 8)  # int4: 0.5
            if self.local:  # stand-in: this device's buffer k times
                full = stand_in(jnp.broadcast_to(flat, (k,) + flat.shape))
            else:
                with jax.named_scope("pp_fsdp"):
                    full = lax.all_gather(flat, axes, axis=0)  # (k, L), devices in mesh order
            at = 0
            for (i, dim), x in zip(members, shares, strict=True):
                part = full[:, at : at + x.size].reshape((k,) + x.shape)  # (k, ..., s_dim, ...)
                at += x.size
                whole = x.shape[:dim] + (k * x.shape[dim],) + x.shape[dim + 1 :]
                leaves[i] = jnp.moveaxis(part, 0, dim).reshape(whole)
        return jax.tree.unflatten(treedef, leaves)

    def received_bytes(self, info, p):
        return (self.degree - 1) * nbytes(info)  # all-gather of a layer's shares


@functools.cache
def _gathering(cls: type, op: FSDPGather) -> type:
    """`cls` whose parameters pass through `op.gather_weights` on their way in (Flax
    `map_variables`), after its input exists: one class per layer type and op."""
    mapped = nn.map_variables(cls, "params", trans_in_fn=op.gather_weights, mutable=False)

    class Gathering(mapped):
        def __call__(self, *args, **kwargs):
            arrays = [a for a in jax.tree.leaves((args, kwargs)) if isinstance(a, jax.Array)]
            token = _AFTER.set(arrays[0] if arrays else None)
            try:
                return super().__call__(*args, **kwargs)
            finally:
                _AFTER.reset(token)

    Gathering.__name__ = Gathering.__qualname__ = cls.__name__
    return Gathering


def _after_input(flat: jax.Array) -> jax.Array:
    """`flat` (1-D) unchanged, but computed after the running layer's input: + (-0.0) made from
    one element of the input (finite or not, -|0 x where(finite(t), t, 0)| is -0.0, and v + -0.0
    is v for every v). Without it XLA's CPU scheduler (which drops optimization barriers) issues
    every layer's all-gather at the start of the program, so all weights are whole at once."""
    t = _AFTER.get()
    if t is None:
        return flat
    t = t[(0,) * t.ndim].astype(jnp.float32)  # one element, by index (no reshape of t)
    zero = -jnp.abs(0.0 * jnp.where(jnp.isfinite(t), t, 0.0))
    return flat + zero.astype(flat.dtype)
