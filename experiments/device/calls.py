"""What the device scripts share: the packages a part needs, a denoiser's call inputs with
random values, and a compiled call timed (experiments/device/*.py)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

# import name -> the package pip installs it from
PACKAGES = {"yaml": "pyyaml", "docstring_parser": "docstring-parser"}


def needs(*modules: str) -> None:
    """Exit with one line naming the missing package(s) and how to bring them, when a device
    part runs where they are not installed (the TPU machine's index lacks some: they travel as
    wheels)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join(PACKAGES.get(m, m) for m in missing)
        sys.exit(
            f"{sys.argv[0]}: missing package(s) {names}: run `bash experiments/device/"
            f"wheels_tpu.sh` here and carry .whl-tpu (experiments/device/tpu_suite.sh installs "
            f"them), or pip install them"
        )


def sized(fn, model: str, text: str):
    """(denoiser, (height, width) pixels of its input) for a size `text`: `1024` (a square
    image) or `HxWxF` (a video of F frames of H x W: the video denoiser on its latent frames,
    laid out frame after frame as one tall image of F_latent x H rows)."""
    parts = [int(v) for v in str(text).split("x")]
    if len(parts) == 1:
        return fn, (parts[0], parts[0])
    if len(parts) != 3 or not hasattr(fn, "with_video"):
        raise SystemExit(f"size {text!r}: a number (pixels of a square image) or HxWxF (a "
                         f"video, for a video model)")  # fmt: skip
    from patchpar.models.presets import temporal_factor
    from patchpar.models.video import on_video

    h, w, frames = parts  # pixels: the tall image's rows are the latent frames' x h
    at, (rows, _) = on_video(fn, frames, "frames", temporal_factor(model), (h, w))
    return at, (rows, w)


def random_inputs(fn, model: str, resolution, dtype, batch: int = 2):
    """(x, t, ctx, added) for one call of `fn` (a preset's denoiser) at `resolution` pixels
    (square, or (height, width)): normal latent and text states, timestep 500, a text mask with
    every token present, the other keyword inputs uniform in [0, 1)."""
    import jax.numpy as jnp
    import numpy as np

    from patchpar.models.presets import latent_factor

    h, w = resolution if isinstance(resolution, tuple) else (resolution, resolution)
    f = latent_factor(model)
    (x, t, ctx), added = fn.example_inputs(batch, h // f, w // f)
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(*x.shape), dtype)
    ctx = jnp.asarray(rng.randn(*ctx.shape), dtype)
    t = jnp.full(t.shape, 500.0, jnp.float32)
    added = {
        k: jnp.ones(v.shape, v.dtype)
        if jnp.issubdtype(v.dtype, jnp.integer)
        else jnp.asarray(rng.rand(*v.shape), v.dtype)
        for k, v in added.items()
    }
    return x, t, ctx, added


def timed(compiled, args, kwargs, repeats: int) -> tuple[object, list[float]]:
    """(the first call's output, the seconds of `repeats` calls after it)."""
    import jax

    out = jax.block_until_ready(compiled(*args, **kwargs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args, **kwargs))
        times.append(time.perf_counter() - t0)
    return out, times


def compile_and_time(f, args, kwargs, repeats: int, rec: dict):
    """Compile the jitted `f` for `args`/`kwargs` and time it: `rec` gets `compile_s`,
    `memory_compiled` (XLA's buffer assignment), `step_s_median` and `step_s_all`; returns the
    first call's output."""
    import time

    from patchpar.measure.cost import memory_per_device

    t0 = time.perf_counter()
    compiled = f.lower(*args, **kwargs).compile()
    rec["compile_s"] = time.perf_counter() - t0
    rec["memory_compiled"] = memory_per_device(compiled)
    out, times = timed(compiled, args, kwargs, repeats)
    rec["step_s_median"] = median(times)
    rec["step_s_all"] = times
    return out


def median(times: list[float]) -> float:
    return statistics.median(times)
