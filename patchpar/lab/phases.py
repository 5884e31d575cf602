"""A run's phase programs (`Pipeline.denoise_phases`: one per phase, the later ones taking
what the earlier ones leave) lowered and compiled at once, in threads (docs/design.md §8)."""

from __future__ import annotations


def compile_phases(programs, args):
    """Each phase's program (`pipe.denoise_phases`) lowered on what the one before it returns,
    and all compiled at once, in threads (XLA compiles without the GIL): ([(phase, steps,
    compiled)], {phase: (lowered, its site calls)}, {phase: its abstract inputs (x, loop)}).
    A later phase is lowered before the one before it is compiled, on its outputs' shapes and
    dtypes, the compiler choosing their placement; where it chose another placement than the
    phase before leaves them in (not seen so far: tested for DistriFusion, PipeFusion and
    AsyncDiff), that phase is lowered and compiled again
    on the compiled outputs."""
    from concurrent.futures import ThreadPoolExecutor

    import jax

    from patchpar.parallel.sites import record_sites
    from patchpar.pipelines.phased import outputs_abstract

    def lower(fn, x, loop):
        with record_sites() as calls:  # the site calls of its loop body: one step's
            return jax.jit(fn).lower(*args[:3], x, loop), calls

    x, loop, staged = args[3], None, []
    for phase, n, fn in programs:
        low, calls = lower(fn, x, loop)
        staged.append([phase, n, fn, low, calls, (x, loop)])
        x, loop = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), low.out_info)
    with ThreadPoolExecutor(len(staged)) as pool:
        done = list(pool.map(lambda st: st[3].compile(), staged))
    for k in range(1, len(staged)):
        if not _placed_alike(done[k - 1], done[k]):
            x, loop = outputs_abstract(done[k - 1])
            staged[k][3], staged[k][4] = lower(staged[k][2], x, loop)
            staged[k][5] = (x, loop)
            done[k] = staged[k][3].compile()
    compiled = [(st[0], st[1], c) for st, c in zip(staged, done, strict=True)]
    lowered = {st[0]: (st[3], st[4]) for st in staged}
    return compiled, lowered, {st[0]: st[5] for st in staged}


def _placed_alike(before, after) -> bool:
    """Whether compiled phase `after` takes its (x, loop) placed as compiled `before` leaves
    them (a steady phase of PipeFusion or AsyncDiff reads its loop, not x)."""
    import jax

    given = jax.tree.leaves(before.output_shardings)
    # an input the program does not read has no placement (None): never transferred
    taken = jax.tree.leaves(after.input_shardings[0][3:], is_leaf=lambda v: v is None)
    shapes = jax.tree.leaves(before.out_info)
    return len(given) == len(taken) and all(
        b is None or a.is_equivalent_to(b, len(sh.shape))
        for a, b, sh in zip(given, taken, shapes, strict=True)
    )
