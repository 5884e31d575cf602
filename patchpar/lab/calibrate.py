"""`patchpar calibrate`: each patch device's speed on the patch it would run, and the patch
weights that follow (`--patch-weights` of `generate` and `run`; `--patch-weights measured`
measures them at the start of the run itself). STADI's spatial half: a faster device takes
more rows (patchpar/measure/calibrate.py says what is timed)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from patchpar.lab.config import AbstractModel
from patchpar.lab.configio import FromFlags

MEASURED = "measured"  # `--patch-weights measured`: timed at the start of the run


@dataclass(frozen=True)
class CalibrateConfig(FromFlags):
    """Time one denoiser step on the largest patch of the most even split, on every device at
    once (launched processes: each on its own core, as `generate --processes N` runs), and
    print each device's seconds and the patch weights (speeds relative to the fastest) to pass
    as `--patch-weights`. Random weights: only the model's config.json is read."""

    model: AbstractModel = field(default_factory=lambda: AbstractModel(name="tiny"))
    devices: int = 2
    """Patch devices to time (every device a patch device)."""
    processes: int = 0
    """0: the devices of this process, one after the other (fake CPU devices share the cores:
    they time alike). N = devices: launch N processes, one core each, timed at the same time."""
    height: int | None = None
    """Image height in pixels (default: the denoiser's sample size x the VAE factor)."""
    width: int | None = None
    """Image width in pixels (default: as height)."""
    dtype: str = "float32"
    """float32 or bfloat16."""
    repeats: int = 5
    """Timed steps per device (the median is kept), after one that compiles."""
    out: Path = Path("runs/calibrate/calibrate.json")
    """Where the result is written (JSON)."""
    timeout_s: float = 1800.0
    """processes >= 1: end every worker after this many seconds."""


def check(config: CalibrateConfig) -> None:
    """Every check before any work (all problems at once, one line each)."""
    from patchpar.lab.checks import Problems

    problems = Problems.collect()
    if config.devices < 1:
        problems.lines.append(f"devices={config.devices}: must be >= 1")
    if config.processes not in (0, config.devices):
        problems.lines.append(
            f"processes={config.processes}: must be 0 or devices={config.devices} (one device "
            f"per launched process)"
        )
    if config.repeats < 1:
        problems.lines.append(f"repeats={config.repeats}: must be >= 1")
    if config.dtype not in ("float32", "bfloat16"):
        problems.lines.append(f"dtype={config.dtype!r}; known: ['float32', 'bfloat16']")
    if config.model.quant != "none":
        problems.lines.append(
            f"model.quant={config.model.quant!r}: calibrate times the unquantized denoiser; "
            f"leave it none"
        )
    for name in ("height", "width"):
        if (v := getattr(config, name)) is not None and v <= 0:
            problems.lines.append(f"{name}={v}: must be a positive number of pixels")
    with problems.check():
        from patchpar.lab.checks import images_only

        images_only(config.model.name, "calibrate")
        slab(config)
    problems.raise_any()


def slab(config: CalibrateConfig) -> tuple[int, int]:
    """The latent rows x columns of the largest patch of the most even split."""
    from patchpar.models.presets import abstract_denoiser, latent_factor
    from patchpar.parallel.split import split_rows

    unet = abstract_denoiser(config.model.name)
    f = latent_factor(config.model.name)
    size = unet.config.sample_size * f
    h = size if config.height is None else config.height
    w = h if config.width is None else config.width
    if h % f or w % f:
        raise ValueError(f"{h}x{w} pixels: each side must be a multiple of the VAE factor {f}")
    rows = split_rows(h // f, config.devices, unet.row_multiple, None, unet.row_multiple_reason)
    return max(rows), w // f


def run_calibrate(config: CalibrateConfig, args: list[str], log=lambda msg: None) -> dict:
    """The devices' seconds per step and their patch weights; process 0 (or the only one)
    writes them to `config.out`."""
    import jax.numpy as jnp

    from patchpar.lab.launch import in_worker, is_writer, launch
    from patchpar.lab.results import check_writable
    from patchpar.measure.calibrate import devices_seconds, speed_weights
    from patchpar.models.components import random_params_on_device
    from patchpar.models.presets import abstract_denoiser

    if config.processes and not in_worker():
        check(config)
        done = check_writable(config.out.parent, "out") / config.out.name
        done.unlink(missing_ok=True)
        launch(args, config.processes, config.timeout_s, lambda m: print(m, file=sys.stderr))
        return json.loads(done.read_text())
    check(config)
    hw = slab(config)
    log(f"timing one step of {config.model.name} on a {hw[0]}x{hw[1]} latent slab on "
        f"{config.devices} device(s)")  # fmt: skip
    unet = abstract_denoiser(config.model.name, getattr(jnp, config.dtype))
    params = random_params_on_device(unet.abstract_params(), 0)
    seconds = devices_seconds(unet, params, hw, config.devices, config.repeats)
    weights = speed_weights(seconds)
    record = {
        "model": config.model.name,
        "slab": list(hw),
        "dtype": config.dtype,
        "processes": config.processes,
        "seconds_per_step": seconds,
        "patch_weights": ",".join(f"{w:g}" for w in weights),
    }
    if is_writer():
        check_writable(config.out.parent, "out").mkdir(parents=True, exist_ok=True)
        tmp = config.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(config.out)
    return record


def format_calibrate(record: dict) -> str:
    lines = ["| device | ms per step | weight |", "|---|---|---|"]
    weights = record["patch_weights"].split(",")
    for i, (s, w) in enumerate(zip(record["seconds_per_step"], weights, strict=True)):
        lines.append(f"| {i} | {s * 1e3:.1f} | {w} |")
    return "\n".join(lines) + f"\n--patch-weights {record['patch_weights']}"


def measured_plan(plan, unet, params, latent_hw: tuple[int, int], log, repeats: int = 3):
    """`plan` with its patch weights measured on its devices now (`--patch-weights measured`),
    floored so that every device takes at least one unit of rows; and the seconds."""
    from patchpar.measure.calibrate import devices_seconds, speed_weights
    from patchpar.parallel.split import floored

    rows = replace(plan, patch_weights=None).row_split(latent_hw[0], unet)
    hw = (max(rows), latent_hw[1])
    log(f"measuring each device's speed: one step on a {hw[0]}x{hw[1]} latent slab")
    seconds = devices_seconds(unet, params, hw, plan.patch, repeats)
    weights = floored(speed_weights(seconds), latent_hw[0], unet.row_multiple)
    log("measured seconds per step " + ", ".join(f"{s:.3f}" for s in seconds)
        + " -> patch weights " + ",".join(f"{w:.3g}" for w in weights))  # fmt: skip
    return replace(plan, patch_weights=weights), seconds
