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


def time_runs(fn: Callable[[], object], warmup: int, repeats: int) -> tuple[object, dict]:
    """Run `warmup` times untimed, then `repeats` times timed. Returns the last result and
    {median, min, max, all} in seconds."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be >= 1")
    out = None
    for _ in range(warmup):
        out, _ = timed(fn)
    times = []
    for _ in range(repeats):
        out, dt = timed(fn)
        times.append(dt)
    return out, {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "all": [round(t, 6) for t in times],
    }
