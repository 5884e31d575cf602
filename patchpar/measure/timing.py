"""Wall-clock timing of compiled programs: compilation apart from steady runs; untimed warm-up
runs, then repeats, each waited for with `block_until_ready`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """(result, seconds) of one call, waiting for every output array."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def time_calls(name: str, fn: Callable[[], object], repeats: int) -> tuple[object, dict]:
    """A first call (compilation included) timed apart, then `repeats` timed calls: (the last
    result, {name_first, name_median, name_min, name_max} in seconds)."""
    out, first = timed(fn)
    times = []
    for _ in range(repeats):
        out, dt = timed(fn)
        times.append(dt)
    return out, {
        f"{name}_first": first,
        f"{name}_median": statistics.median(times),
        f"{name}_min": min(times),
        f"{name}_max": max(times),
    }


def time_phases(
    phases: list[tuple[str, Callable]], args: tuple, warmup: int, repeats: int
) -> tuple[object, dict]:
    """Time a program split into phases: each `fn(*args[:-1], x, loop) -> (x, loop)`, run in
    order from `x = args[-1]`, `loop = None`, each waited for before the next starts. Runs
    `warmup` times untimed, then `repeats` times timed. Returns the last (x, loop) and
    {median, min, max, all} of the whole, plus {"phases": {name: {median, all}}}."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")

    def once():
        x, loop, times = args[-1], None, []
        for _, fn in phases:
            (x, loop), dt = timed(lambda fn=fn, x=x, loop=loop: fn(*args[:-1], x, loop))
            times.append(dt)
        return (x, loop), times

    out = None
    for _ in range(warmup):
        out, _ = once()
    runs = []
    for _ in range(repeats):
        out, times = once()
        runs.append(times)
    totals = [sum(r) for r in runs]
    return out, {
        "median": statistics.median(totals),
        "min": min(totals),
        "max": max(totals),
        "all": [round(t, 6) for t in totals],
        "phases": {
            name: {
                "median": statistics.median(r[k] for r in runs),
                "all": [round(r[k], 6) for r in runs],
            }
            for k, (name, _) in enumerate(phases)
        },
    }
