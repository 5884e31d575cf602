"""Tensor parallelism's site: the all-reduce over the `model` axis of a row-split layer's
partial output (Megatron; the released DistriFusion's sync tensor-parallel baseline). Layers
split their weights `degree` ways (`SiteOps.model_degree`); site `tp`, scope `pp_tp`."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax import lax

from patchpar.parallel.mesh import MODEL
from patchpar.parallel.sites.common import Site, nbytes, note, stand_in


@dataclass(frozen=True)
class TensorSum(Site):
    kind = "tp"
    degree: int = 1  # devices on the model axis

    def __call__(self, mod, y: jax.Array) -> jax.Array:
        note(self, shape=y.shape, itemsize=y.dtype.itemsize)
        if self.degree == 1:
            return y
        if self.local:
            return stand_in(y)
        with jax.named_scope("pp_tp"):
            return lax.psum(y, MODEL)

    def received_bytes(self, info, p):
        return 2 * (self.degree - 1) * nbytes(info) // self.degree  # ring all-reduce
