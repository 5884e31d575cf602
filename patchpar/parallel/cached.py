"""A denoiser call under a step cache (`patchpar.sampling.cache`), inside one device's
program or on one device alone: the model runs as its parts (`prologue`, `blocks(lo, hi)`,
`epilogue`), the strategy's stale collection threaded through them, and the cache decides
which blocks run. Used by the engine's step program and by the one-device pipeline."""

from __future__ import annotations

from patchpar.sampling.cache import first_block_step
from patchpar.sampling.guidance import call_on_stack


def cached_call(cache, module, variables, mutable, exchanged, x, t, cond, state, reduce_sum):
    """One model call under a step cache, inside one device's program: (output (G, B, h, W,
    C), the stale buffers after the call, the cache's new state). The model runs as its parts
    (`prologue`, `blocks`, `epilogue`), the stale collection threaded through them; the
    skip decision's two sums are all-reduced over every device (`sampling.cache`)."""

    def part(method, variables, *args, **kw):
        return module.apply(variables, *args, method=method, mutable=mutable, **kw)

    def run(xs, ts, ctx, **added):
        def head():
            (hs0, aux), mut = part("prologue", variables, xs, ts, ctx, **added)
            hs1, mut = part("blocks", {**variables, **mut}, 0, 1, hs0, aux)
            return hs0, hs1, (aux, mut)

        def tail(hs1, carry):
            aux, mut = carry
            last, mut = part("blocks", {**variables, **mut}, 1, module.num_blocks, hs1, aux)
            return last, exchanged(mut)

        def skip(carry):  # the skipped blocks' buffers as they were; the first block's sent
            return exchanged(carry[1])

        last, stale, new, (aux, _) = first_block_step(cache, state, head, tail, skip, reduce_sum)
        out, _ = part("epilogue", variables, last, aux)
        return out, stale, new

    return call_on_stack(run, x, t, cond)
