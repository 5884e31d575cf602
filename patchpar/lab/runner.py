"""`patchpar run`: one experiment run -> one record in `<results>/<experiment>/runs.jsonl`.

For the prompt set (every prompt x seed) the runner generates under the configured strategy,
timing compilation apart from steady runs; counts bytes per device and FLOPs from the lowered
step programs; and compares the images with the single-device outputs of the same model,
sampler, prompts and seeds (made once, cached under `<results>/.baselines/`, reused by every
later run with the same key). A run that fails still leaves a record, with status `error` or
`oom` and the message (docs/design.md §6).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from patchpar.lab.baselines import (
    baseline_folder,
    baseline_key,
    load_or_make_baseline,
    weights_sha256,
)
from patchpar.lab.config import RunConfig, build_plan, to_dict
from patchpar.lab.evaluate import quality_metrics
from patchpar.lab.generation import batches, get_pipeline, image_size, inputs
from patchpar.lab.results import append_record, provenance

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def runs_path(config: RunConfig) -> Path:
    return Path(config.results) / config.experiment / "runs.jsonl"


def point_key(config: RunConfig | dict) -> str:
    """What makes two runs the same point: the whole config except where records are written."""
    d = to_dict(config) if isinstance(config, RunConfig) else dict(config)
    d.pop("results", None)
    return json.dumps(d, sort_keys=True)


def comm_metrics(pipe, plan, config: RunConfig, hw, batch: int) -> dict:
    """Bytes received per device per step (warm-up, steady, and the mean over the run's steps),
    FLOPs per device of one steady step, from the lowered programs (patchpar.measure.cost)."""
    from patchpar.measure.cost import measure

    f = pipe.latent_factor
    latent_hw = (hw[0] // f, hw[1] // f)
    measured = plan if plan.strategy.parallel else build_plan("sync_patch", {}, 1, 1)
    r = measure(
        pipe.unet, measured, latent_hw, batch=batch,
        guidance_scale=config.sampler.guidance_scale,
    )  # fmt: skip
    wu, st = r["phases"]["warmup"], r["phases"]["steady"]
    n = config.sampler.steps
    sync = plan.strategy.sync_steps(n)
    w_bytes, s_bytes = wu["hlo"]["all"]["max"], st["hlo"]["all"]["max"]
    rw, rs = wu["released"]["all"]["max"], st["released"]["all"]["max"]
    return {
        # analytic: the released DistriFusion / PCPP code's traffic pattern for the same run
        "released_bytes_per_device_per_step": (sync * rw + (n - sync) * rs) / n,
        "warmup_bytes_per_device": w_bytes,
        "steady_bytes_per_device": s_bytes,
        "bytes_per_device_per_step": (sync * w_bytes + (n - sync) * s_bytes) / n,
        "bytes_per_device_total": sync * w_bytes + (n - sync) * s_bytes,
        "flops_per_device_per_step": st.get("flops_per_device"),
        "analytic_matches_hlo": bool(wu["analytic_matches_hlo"] and st["analytic_matches_hlo"]),
    }


def timed_denoise(pipe, config: RunConfig, plan, cond, x0, log: Log):
    """Compile the denoising program (timed apart), run it `warmup_runs` times, then time
    `repeats` runs. Returns (final latent, timing metrics)."""
    from patchpar.measure.timing import time_runs
    from patchpar.parallel.engine import stale_bytes_per_device

    s, m = config.sampler, config.measure
    t0 = time.perf_counter()
    lowered, args = pipe.lower_denoise(cond, x0, s.name, s.steps, s.guidance_scale, plan)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    log(f"  compiled in {compile_s:.1f} s; timing {m.repeats} run(s)")
    (final, state), t = time_runs(lambda: compiled(*args), m.warmup_runs, m.repeats)
    b = x0.shape[0]
    return final, {
        "compile_s": compile_s,
        "batch": b,
        "denoise_s_median": t["median"],
        "denoise_s_min": t["min"],
        "denoise_s_max": t["max"],
        "denoise_s_all": t["all"],
        "step_s_median": t["median"] / s.steps,
        "images_per_s": b / t["median"],
        "stale_bytes_per_device": stale_bytes_per_device(state),
    }


def _execute(config: RunConfig, run_dir: Path, log: Log) -> tuple[dict, list[str]]:
    s, m = config.sampler, config.measure
    t0 = time.perf_counter()
    pipe = get_pipeline(config.model.name, s.dtype)
    metrics: dict = {"load_s": time.perf_counter() - t0}
    plan = config.plan()
    hw = image_size(pipe, config)
    pipe.check_size(*hw)
    f = pipe.latent_factor
    plan.validate(pipe.unet, (hw[0] // f, hw[1] // f), s.steps, s.guidance_scale)
    metrics["height"], metrics["width"] = hw
    metrics["strategy"] = plan.strategy.describe()
    metrics["sync_steps"] = plan.strategy.sync_steps(s.steps) if plan.strategy.parallel else s.steps

    images, latents = [], []
    for i, batch in enumerate(batches(config)):
        cond, x0 = inputs(pipe, config, batch, hw)
        if i == 0:  # the timed call
            final, timing = timed_denoise(pipe, config, plan, cond, x0, log)
            metrics.update(timing)
        else:
            final = pipe.denoise(cond, x0, s.name, s.steps, s.guidance_scale, plan)
        images.append(pipe.decode(final))
        latents.append(np.asarray(final, np.float32))
    images, latents = np.concatenate(images), np.concatenate(latents)

    if m.comm:
        log("  counting communication and FLOPs")
        metrics.update(comm_metrics(pipe, plan, config, hw, metrics["batch"]))

    if m.quality:
        own = (images, latents) if not plan.strategy.parallel else None
        ref = load_or_make_baseline(pipe, config, hw, log, made=own)
        metrics.update(quality_metrics(config, images, ref, log))
        base_lat = np.load(baseline_folder(config) / "latents.npy")
        metrics["latent_max_abs_diff"] = float(np.abs(latents - base_lat).max())

    paths = []
    if m.save_images:
        from PIL import Image

        run_dir.mkdir(parents=True, exist_ok=True)
        seeds = [seed for b in batches(config) for _, seed in b]
        n_prompts = len(config.prompts.prompts)
        for k, (img, seed) in enumerate(zip(images, seeds, strict=True)):
            path = run_dir / f"p{k % n_prompts}_s{seed}.png"
            Image.fromarray(img).save(path)
            paths.append(str(path.relative_to(run_dir.parent.parent)))
    return metrics, paths


def _status(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    oom = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM")
    return "oom" if any(k in text for k in oom) or isinstance(err, MemoryError) else "error"


def run(config: RunConfig, log: Log = _stderr, raise_errors: bool = False) -> dict:
    """Run one experiment point and append its record (also when it fails); returns the record.
    With `raise_errors` (the CLI) a config that does not validate raises ValueError before
    anything is written; without (a sweep) it becomes a record with status `error`."""
    try:
        config.validate()
        invalid = None
    except ValueError as e:
        if raise_errors:
            raise
        invalid = e
    run_id = uuid.uuid4().hex[:12]
    out = runs_path(config)
    if invalid is None:
        strategy = config.plan().strategy
        # the strategy with every option, defaults included (the config holds only those set)
        strategy_record = {"name": strategy.name, **dataclasses.asdict(strategy)}
    else:
        strategy_record = {"name": config.strategy.name, **config.strategy.options()}
    record = {
        "run_id": run_id,
        "experiment": config.experiment,
        "label": config.strategy.label(),
        "strategy": strategy_record,
        "config": to_dict(config),
        "baseline": baseline_key(config) if config.measure.quality else None,
        "provenance": {**provenance(), "weights_sha256": weights_sha256(config)},
    }
    if invalid is not None:
        record.update(status="error", error=f"invalid config: {invalid}", metrics={}, images=[])
        return append_record(out, record)
    log(f"run {run_id}: {config.strategy.label()} on {config.mesh.devices} device(s)")
    try:
        metrics, images = _execute(config, out.parent / "images" / run_id, log)
        record.update(status="ok", error=None, metrics=metrics, images=images)
    except Exception as e:  # a failed point is a row with its status (docs/design.md §6)
        record.update(
            status=_status(e),
            error=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc(limit=8),
            metrics={},
            images=[],
        )
        if raise_errors:
            append_record(out, record)
            raise
    return append_record(out, record)
