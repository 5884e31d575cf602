"""A denoiser call under a step cache (`patchpar.sampling.cache`), inside one device's
program or on one device alone. The cache drives the model through `ModelParts`: the whole
forward, or its parts (`prologue`, `blocks(lo, hi)`, `epilogue`), with the strategy's stale
collection threaded through them and the packed stale exchange after them. Used by the
engine's step program and by the one-device pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from patchpar.parallel.sites import STALE, shapes_only
from patchpar.sampling.guidance import call_on_stack


@dataclass(frozen=True)
class DecisionSum:
    """The all-reduce of a data-dependent cache decision's sums over the `n` devices that hold
    other rows, halves or images (site `cache`): its analytic bytes, as a site op's."""

    n: int
    kind: str = "cache"

    def received_bytes(self, info: dict, p: int) -> int:
        return 2 * (self.n - 1) * info["bytes"] // self.n if self.n > 1 else 0  # ring

    released_bytes = received_bytes  # the released codes have no cache: the same op

    def padding_bytes(self, info: dict, p: int) -> int:
        return 0  # sums, not rows


@dataclass
class ModelParts:
    """One guidance stack's model call, as a step cache runs it: `whole()`; or `head()`,
    `tail(...)` / `skip(...)` and `epilogue(...)` (a DiT's output layers have no site, so
    `epilogue` keeps no buffer); or `prologue()`, `span(...)` and `close(...)`, which runs the
    epilogue with its sites (a UNet's). Each returns the stale buffers after its exchange."""

    module: Any
    variables: dict
    mutable: list
    exchanged: Any  # mutated collections -> the stale buffers after the call's sends
    args: tuple  # (xs, ts, context)
    added: dict

    def _part(self, method, variables, *args, **kw):
        return self.module.apply(variables, *args, method=method, mutable=self.mutable, **kw)

    @property
    def num_blocks(self) -> int:
        return self.module.num_blocks

    @property
    def teacache_coefficients(self) -> tuple[float, ...]:
        """TeaCache's rescaling polynomial of the family (highest power first): its module's
        `teacache_coefficients`, published (FLUX.1) or patchpar's own fit (PixArt)."""
        return self.module.teacache_coefficients

    quiet = staticmethod(shapes_only)  # a shape trace's site calls are not the program's

    def own(self, a):
        """`a` (B, rows or tokens, ...) with what is not this device's patch zeroed (uneven
        patches' padding: a decision's sums are the image's, `parallel.split`)."""
        mine = self.module.ops.own_rows(a.shape[1])
        if mine is None:
            return a
        keep = jnp.arange(a.shape[1]) < mine
        return jnp.where(keep.reshape((1, -1) + (1,) * (a.ndim - 2)), a, jnp.zeros_like(a))

    def whole(self):
        """(the model's output, the stale buffers after it)."""
        out, mut = self.module.apply(self.variables, *self.args, **self.added, mutable=self.mutable)
        return out, self.exchanged(mut)

    def incoming(self) -> dict:
        """The stale buffers as the call received them (what a skipped call leaves)."""
        return self.variables.get(STALE, {})

    def prologue(self):
        """(hs before the first block, carry: aux and the mutated collections)."""
        (hs0, aux), mut = self._part("prologue", self.variables, *self.args, **self.added)
        return hs0, (aux, mut)

    def modulated(self, hs0, carry):
        """The first block's modulated image input (`modulated` of the family's module)."""
        out, _ = self._part("modulated", {**self.variables, **carry[1]}, hs0, carry[0])
        return out

    def all_blocks(self, hs0, carry):
        """Every block: (hs after the last, the stale buffers after all sends)."""
        aux, mut = carry
        last, mut = self._part("blocks", {**self.variables, **mut}, 0, self.num_blocks, hs0, aux)
        return last, self.exchanged(mut)

    def head(self):
        """(hs before the first block, hs after it, carry: aux and the mutated collections)."""
        (hs0, aux), mut = self._part("prologue", self.variables, *self.args, **self.added)
        hs1, mut = self._part("blocks", {**self.variables, **mut}, 0, 1, hs0, aux)
        return hs0, hs1, (aux, mut)

    def tail(self, hs1, carry):
        """The blocks after the first: (hs after the last, the stale buffers after all sends)."""
        aux, mut = carry
        last, mut = self._part("blocks", {**self.variables, **mut}, 1, self.num_blocks, hs1, aux)
        return last, self.exchanged(mut)

    def skip(self, carry):
        """The stale buffers when the blocks after the first are skipped: theirs as they came
        in, the first block's sent."""
        return self.exchanged(carry[1])

    def span(self, lo, hi, hs, carry):
        """Blocks [lo, hi) on `hs`: (hs after them, carry with their mutated collections)."""
        aux, mut = carry
        out, mut = self._part("blocks", {**self.variables, **mut}, lo, hi, hs, aux)
        return out, (aux, mut)

    def close(self, hs, carry):
        """The epilogue after the blocks run so far, with its sites (a UNet's output norm and
        convolution): (the model's output, the stale buffers after every send; those of
        blocks that did not run as they came in)."""
        aux, mut = carry
        out, mut = self._part("epilogue", {**self.variables, **mut}, hs, aux)
        return out, self.exchanged(mut)

    def epilogue(self, hs, carry):
        out, _ = self._part("epilogue", self.variables, hs, carry[0])
        return out


def cached_call(cache, module, variables, mutable, exchanged, x, t, cond, state, reduce_sum):
    """One model call under a step cache, inside one device's program: (output (G, B, h, W,
    C), the stale buffers after the call, the cache's new state). `reduce_sum` sums over every
    device (a data-dependent decision is taken on all-reduced sums; identity on one device)."""

    def run(xs, ts, ctx, **added):
        parts = ModelParts(module, variables, mutable, exchanged, (xs, ts, ctx), added)
        return cache.call(parts, state, reduce_sum)

    return call_on_stack(run, x, t, cond)
