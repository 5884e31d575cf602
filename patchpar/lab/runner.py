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
import math
import os
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import numpy as np

from patchpar.lab.baselines import (
    baseline_folder,
    baseline_key,
    load_or_make_baseline,
    weights_sha256,
)
from patchpar.lab.calibrate import MEASURED, measured_plan
from patchpar.lab.checks import Problems, check_plan_on_model, check_video_metrics
from patchpar.lab.config import RunConfig, unused_options
from patchpar.lab.configio import dump_config, point_config, to_dict
from patchpar.lab.evaluate import check_quality_inputs, quality_metrics
from patchpar.lab.generation import (
    at_run,
    batches,
    final_latents,
    get_pipeline,
    image_size,
    inputs,
)
from patchpar.lab.launch import WorkerFailed, in_worker, launch
from patchpar.lab.measures import Log, comm_metrics, timed_decode, timed_denoise, timed_encode
from patchpar.lab.results import (
    append_record,
    check_writable,
    provenance,
    read_records,
)
from patchpar.lab.speedup import speedups


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def runs_path(config: RunConfig) -> Path:
    return Path(config.results) / config.experiment / "runs.jsonl"


def point_key(config: RunConfig | dict) -> str:
    """What makes two runs the same point: the whole config except where records are written
    (`config.point_config`, older records' missing fields filled in as they ran)."""
    return json.dumps(point_config(config), sort_keys=True)


def checked_plan(config: RunConfig, pipe, devices_present: bool = True):
    """(the point's plan, image or frame size (h, w), the pipeline making the run's images or
    videos: `at_run`), every check of the plan against the model done (ValueError naming what
    does not fit). `devices_present=False` (a sweep's dry run of a point that runs in launched
    processes): the mesh is not built here."""
    s = config.sampler
    plan = config.plan()
    hw = image_size(pipe, config)
    pipe = at_run(pipe, config, plan, hw)
    latent = pipe.check_size(*hw)  # a video's: its frames' rows stacked
    gs = pipe.text.loop_scale(s.guidance_scale)  # the loop's CFG scale (FLUX.1: 1 or true CFG)
    plan.validate(pipe.unet, latent, s.steps, gs, build_mesh=devices_present)
    if getattr(pipe, "makes_video", False):  # as VideoPipeline.__call__ checks a vae_plan
        from patchpar.parallel.vae import check_video_plan

        check_video_plan(config.vae_plan(), pipe.vae, pipe.frame_size(*hw))
        if pipe.vae is None:
            config.vae_plan().validate(None, pipe.frame_size(*hw))
    else:
        f = pipe.latent_factor
        config.vae_plan().validate(pipe.vae, (hw[0] // f, hw[1] // f), len(batches(config)[0]))
    return plan, hw, pipe


def preflight(config: RunConfig) -> None:
    """Every check a run makes before generating, without generating (a sweep's dry run):
    the config, the strategy's options, and the plan against the model (which is loaded)."""
    import jax

    config.validate()
    config.plan()
    m = config.model
    pipe = get_pipeline(m.name, config.sampler.dtype, m.attention_spec(), m.quant)
    pipe = pipe.with_true_cfg(config.sampler.true_cfg_scale).with_scan(m.scan_blocks)
    present = not config.mesh.processes and jax.device_count() >= config.mesh.devices
    checked_plan(config, pipe, devices_present=present)


def _execute(config: RunConfig, run_dir: Path, log: Log, writer: bool = True):
    """Generate, time, count and compare; every process of a multi-process run takes part in
    the generation, the `writer` (process 0) alone counts bytes, scores and saves images."""
    import jax

    from patchpar.parallel.mesh import to_local

    s, m = config.sampler, config.measure
    if jax.process_count() > 1 and config.mesh.devices != jax.device_count():
        raise ValueError(
            f"mesh.devices={config.mesh.devices}: the {jax.process_count()} joined processes have "
            f"{jax.device_count()} devices in all, and a mesh across processes must use every one "
            f"(devices = processes x local devices)"
        )
    # A quantized run's float weights are checked before any quantized work: read (NaN or Inf
    # refused) to quantize them, or matched against the digest of the checked floats its
    # quantized checkpoint was made from (`quant.load_quantized`). The float model itself is
    # loaded only after the run, to make a baseline not yet cached: never beside the timed one.
    t0 = time.perf_counter()
    pipe = get_pipeline(
        config.model.name, s.dtype, config.model.attention_spec(), config.model.quant
    )
    pipe = pipe.with_true_cfg(s.true_cfg_scale).with_scan(config.model.scan_blocks)
    metrics: dict = {"load_s": time.perf_counter() - t0, "layout": process_layout(config)}
    metrics["compute_dtype"] = jax.numpy.dtype(pipe.unet.module.dtype).name
    metrics["attention"] = pipe.unet.module.attn.impl  # resolved when the UNet was loaded
    metrics["quant"] = pipe.quant
    plan, hw, sized = checked_plan(config, pipe)
    if config.mesh.patch_weights == MEASURED:  # timed on these devices now
        # on the loaded denoiser, as `generate` times it (a video model's: its tall latent)
        plan, seconds = measured_plan(plan, pipe.unet, pipe.unet_params, sized.check_size(*hw),
                                      log)  # fmt: skip
        metrics["measured_seconds_per_step"] = seconds
        metrics["patch_weights"] = list(plan.patch_weights)
    pipe = sized
    metrics["height"], metrics["width"] = hw
    if getattr(pipe, "makes_video", False):
        metrics["frames"] = s.frames or pipe.unet.default_frames
    metrics["strategy"] = plan.strategy.describe()
    metrics["mesh_degrees"] = plan.degrees()  # data x cfg x patch x model
    metrics["warmup_phase_steps"] = (
        plan.strategy.warmup_phase_steps(s.steps) if plan.strategy.parallel else s.steps
    )
    if writer and m.quality:
        check_quality_inputs(config)  # before generating, not after

    vae_plan = config.vae_plan()
    decodes = writer or vae_plan.parallel  # a parallel decode needs every process
    images, latents = [], []
    for i, batch in enumerate(batches(config)):
        cond, x0 = inputs(pipe, config, batch, hw)
        if i == 0:  # the timed call: text encoding, denoising and decode timed apart
            metrics.update(timed_encode(pipe, config, batch, hw))
            final, timing, counted = timed_denoise(pipe, config, plan, cond, x0, log)
            final = to_local(final)
            # NaN or Inf: an error naming the step where it first appeared, never a result
            pipe.check_finite_latent(final, cond, x0, s.name, s.steps, s.guidance_scale, plan)
            metrics.update(timing)
            if decodes:
                img, decode_timing = timed_decode(pipe, final, vae_plan, m.repeats)
                metrics.update(decode_timing)
                metrics["vae_parallel"] = (
                    vae_plan.mode if pipe.vae is not None else "none (pixel space)"
                )
                metrics["end_to_end_s_median"] = sum(
                    metrics[k] for k in ("encode_s_median", "denoise_s_median", "decode_s_median")
                )
        else:
            final = pipe.denoise(cond, x0, s.name, s.steps, s.guidance_scale, plan)
            if decodes:
                img = pipe.decode(final, vae_plan)
        if writer:
            images.append(img)
        latents.append(final_latents(pipe, final))
    if not writer:
        return metrics, []
    images, latents = np.concatenate(images), np.concatenate(latents)

    if m.compute_only:  # stand-in collectives: no bytes to count, images not the model's
        return metrics, []
    if m.comm and counted is not None:
        metrics.update(comm_metrics(pipe, plan, config, counted))

    if m.quality:
        # the baseline is uncached `single`: a run on one device with a cache is not it,
        # and it is the unquantized model's
        exact = not plan.strategy.parallel and plan.cache is None and pipe.quant == "none"
        own = (images, latents) if exact else None
        base = pipe  # the float model is loaded only to make a baseline not yet cached
        if pipe.quant != "none" and not _baseline_cached(config):
            base = get_pipeline(config.model.name, s.dtype, config.model.attention_spec())
            base = base.with_true_cfg(s.true_cfg_scale)
        ref = load_or_make_baseline(base, config, hw, log, made=own)
        metrics.update(quality_metrics(config, images, ref, log))
        base_lat = np.load(baseline_folder(config) / "latents.npy")
        metrics["latent_max_abs_diff"] = float(np.abs(latents - base_lat).max())
        check_finite_metrics(metrics)

    paths = []
    if m.save_images:
        from PIL import Image

        from patchpar.lab.video import write_video

        run_dir.mkdir(parents=True, exist_ok=True)
        seeds = [seed for b in batches(config) for _, seed in b]
        n_prompts = len(config.prompts.prompts)
        for k, (img, seed) in enumerate(zip(images, seeds, strict=True)):
            path = run_dir / f"p{k % n_prompts}_s{seed}.png"
            if img.ndim == 4:  # a video: an animated GIF and its frames' grid
                path = write_video(img, run_dir, path.stem)[0]
            else:
                Image.fromarray(img).save(path)
            paths.append(str(path.relative_to(run_dir.parent.parent)))
    return metrics, paths


def _baseline_cached(config: RunConfig) -> bool:
    return (baseline_folder(config) / "images.npy").is_file()


def check_finite_metrics(metrics: dict) -> None:
    """A metric that came out NaN or Inf is an error naming it, never a recorded value."""
    bad = [
        k for k, v in metrics.items()
        if isinstance(v, float) and not math.isfinite(v)
    ]  # fmt: skip
    if bad:
        from patchpar.pipelines.checks import NonFiniteError

        raise NonFiniteError(
            f"metric(s) {', '.join(f'{k}={metrics[k]}' for k in bad)} came out non-finite; the "
            f"images were finite, so the metric's inputs (reference set, features) are at fault"
        )


def process_layout(config: RunConfig) -> dict:
    """Where the run's devices are: processes, devices per process, cores and threads."""
    import jax

    from patchpar.lab.launch import LAYOUT_ENV, cores

    launched = json.loads(os.environ.get(LAYOUT_ENV, "null"))
    return {
        "platform": jax.devices()[0].platform,
        "processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "launched": launched is not None,
        "cores": launched["cores"] if launched else cores(),
        "threads_per_process": 1 if launched else None,
        "cpu_count": os.cpu_count(),
        "oversubscribed": bool(launched and launched["oversubscribed"]),
    }


def _status(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    oom = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM")
    return "oom" if any(k in text for k in oom) or isinstance(err, MemoryError) else "error"


SECTIONS_ON_MODEL = ("model", "mesh", "strategy", "cache", "sampler")


def check_run(config: RunConfig) -> None:
    """Every check of a run before any weight is read, its problems raised together
    (`checks.Problems`, one line each): the config alone (`RunConfig.validate`), and where its
    model, plan and sizes passed, the plan against the model's config.json."""
    problems = Problems.collect()
    with problems.check():
        config.validate()
    s, m = config.sampler, config.model
    # the sections the model check reads; a problem in one is validate's to say (each line
    # starts with the field it names)
    if not any(line.startswith(SECTIONS_ON_MODEL) for line in problems.lines):
        with problems.check():
            check_plan_on_model(  # the plan against the model's config.json
                m.name, config.plan(), s.height, s.width, s.steps, s.guidance_scale,
                s.true_cfg_scale, build_mesh=not config.mesh.processes,
                scan_blocks=m.scan_blocks, frames=s.frames, layout=config.mesh.layout,
            )  # fmt: skip
        with problems.check():
            check_video_metrics(m.name, config.measure.quality)
    problems.raise_any()


RUN_ID_ENV = "PATCHPAR_RUN_ID"  # the launcher's run id, kept by the worker that writes the record


def run(
    config: RunConfig,
    log: Log = _stderr,
    raise_errors: bool = False,
    warn: bool = True,
    tag: str = "",
) -> dict:
    """Run one experiment point and append its record (also when it fails); returns the record.
    With `raise_errors` (the CLI) a config that does not validate raises ValueError before
    anything is written; without (a sweep) it becomes a record with status `error`. Options
    that have no effect are warned of (`warn`; a sweep says each once) and recorded; `tag`
    starts the run's first line of progress (a sweep's `[3/12] `).
    With `mesh.processes` >= 1 the point runs in that many launched processes
    (patchpar.lab.launch); process 0 writes the record."""
    import jax

    from patchpar import compile_cache

    # where the record goes, before any work (a record that cannot be written loses the run)
    check_writable(runs_path(config).parent, "results")
    try:
        check_run(config)
        invalid = None
    except Exception as e:  # noqa: BLE001 - bad input, or a config.json that cannot be read:
        if raise_errors:  # recorded as the point's failure in a sweep, raised from the CLI
            raise
        invalid = e
    run_id = os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:12]
    out = runs_path(config)
    unused = unused_options(config) if invalid is None else []
    if warn and not in_worker():  # a launched worker's launcher has said it already
        for msg in unused:
            log(f"patchpar: warning: {msg}")
    if invalid is None:
        strategy = config.plan().strategy
        # the strategy with every option, defaults included (the config holds only those set)
        strategy_record = {"name": strategy.name, **dataclasses.asdict(strategy)}
    else:
        strategy_record = {"name": config.strategy.name, **config.strategy.options()}
    record = {
        "run_id": run_id,
        "experiment": config.experiment,
        "label": config.label(),
        "strategy": strategy_record,
        "config": to_dict(config),
        "baseline": baseline_key(config) if config.measure.quality else None,
        "provenance": {**provenance(), "weights_sha256": weights_sha256(config)},
        "warnings": unused,  # options given that had no effect (config.unused_options)
    }
    if invalid is not None:
        record.update(status="error", error=f"invalid config: {invalid}", metrics={}, images=[])
        return append_record(out, record)
    if config.mesh.processes >= 1 and not in_worker():
        log(f"{tag}run {run_id}: {config.label()} in {config.mesh.processes} launched "
            f"process(es)")  # fmt: skip
        return _launched(config, record, log, raise_errors)
    compile_cache.enable(warn=lambda msg: log(f"patchpar: warning: {msg}"))  # on unless off
    writer = jax.process_index() == 0  # with several processes, process 0 alone writes
    log(f"{tag}run {run_id}: {config.label()} on {config.mesh.devices} device(s)")
    try:
        metrics, images = _execute(config, out.parent / "images" / run_id, log, writer)
        if writer:
            metrics.update(speedups(config, metrics, out))
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
            if writer:
                append_record(out, record)
            raise
    return append_record(out, record) if writer else record


def _launched(config: RunConfig, record: dict, log: Log, raise_errors: bool) -> dict:
    """Run the point as `mesh.processes` workers (`patchpar run` on the config, joined by
    jax.distributed); returns the record process 0 wrote, or writes an error record naming the
    worker that failed (none is half-written: records are appended whole)."""
    out = runs_path(config)
    run_id = record["run_id"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        dump_config(config, path)
        try:
            launch(["run", str(path)], config.mesh.processes, config.timeout_s, log,
                   env={RUN_ID_ENV: run_id})  # fmt: skip
            failure = None
        except WorkerFailed as e:
            failure = e
    written = [r for r in read_records(out, skip_bad=True) if r.get("run_id") == run_id]
    if written:
        rec = written[-1]
    elif failure is None:
        failure = WorkerFailed(f"the workers ended without writing record {run_id} to {out}")
    if failure is not None and not written:
        record.update(status="error", error=f"WorkerFailed: {failure}", metrics={}, images=[])
        rec = append_record(out, record)
    if failure is not None and raise_errors:
        if failure.exit_code == 2:  # bad input, found by a worker: the CLI says so with code 2
            raise ValueError(str(failure))
        raise failure
    return rec
