"""`patchpar run`: one experiment run -> one record in `<results>/<experiment>/runs.jsonl`.

For the prompt set (every prompt x seed) the runner generates under the configured strategy,
timing compilation apart from steady runs; counts bytes per device and FLOPs from the lowered
step programs; and compares the images with the single-device outputs of the same model,
sampler, prompts and seeds (made once, cached under `<results>/.baselines/`, reused by every
later run with the same key). A run that fails still leaves a record, with status `error` or
`oom` and the message (DESIGN.md §7).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from patchpar.config import RunConfig, build_plan, to_dict
from patchpar.results import append_record, git_commit, provenance

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


# ---------------------------------------------------------------------------- pipelines

_PIPELINES: dict = {}


def get_pipeline(model: str, dtype: str):
    """One loaded pipeline per (model, dtype) per process (a sweep loads each model once)."""
    import jax.numpy as jnp

    from patchpar.pipelines import load_pipeline

    key = (model, dtype)
    if key not in _PIPELINES:
        _PIPELINES[key] = load_pipeline(model, dtype=getattr(jnp, dtype))
    return _PIPELINES[key]


def _image_size(pipe, config: RunConfig) -> tuple[int, int]:
    size = pipe.unet.config.sample_size * pipe.latent_factor
    h = config.sampler.height or size
    return h, config.sampler.width or h


def _batches(config: RunConfig) -> list[list[tuple[str, int]]]:
    """(prompt, seed) pairs, seed-major, cut into pipeline calls."""
    pairs = [(p, s) for s in config.prompts.seeds for p in config.prompts.prompts]
    n = config.prompts.batch_size or len(pairs)
    return [pairs[i : i + n] for i in range(0, len(pairs), n)]


def _inputs(pipe, config: RunConfig, batch: list[tuple[str, int]], hw: tuple[int, int]):
    """Conditioning and initial latents (image (p, s) starts from normal(key(s)))."""
    import jax.numpy as jnp

    s = config.sampler
    prompts = [p for p, _ in batch]
    negative = (
        [config.prompts.negative_prompt] * len(batch) if config.prompts.negative_prompt else None
    )
    cond = pipe.encode_prompt(prompts, negative, s.guidance_scale, *hw)
    latents = jnp.concatenate([pipe.initial_latents(1, *hw, seed) for _, seed in batch])
    return cond, latents


def generate_all(pipe, config: RunConfig, plan, hw) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, H, W, 3) uint8 and final latents for every (prompt, seed), no timing."""
    images, latents = [], []
    s = config.sampler
    for batch in _batches(config):
        cond, x = _inputs(pipe, config, batch, hw)
        final = pipe.denoise(cond, x, s.name, s.steps, s.guidance_scale, plan)
        images.append(pipe.decode(final))
        latents.append(np.asarray(final, np.float32))
    return np.concatenate(images), np.concatenate(latents)


# ---------------------------------------------------------------------------- baseline


def weights_sha256(config: RunConfig) -> str | None:
    """Digest of the model folder the run loads (None when it cannot be read: the run itself
    then fails with the loader's error)."""
    from patchpar.models.loading import weights_digest

    try:
        return weights_digest(model_folder(config.model.name))
    except (OSError, ValueError):
        return None


def _baseline_id(config: RunConfig) -> dict:
    """Same model weights, sampler and prompts (and code) -> same single-device outputs."""
    d = to_dict(config)
    return {
        **{k: d[k] for k in ("model", "sampler", "prompts")},
        "git_commit": git_commit(),
        "weights_sha256": weights_sha256(config),
    }


def baseline_key(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(_baseline_id(config), sort_keys=True).encode()).hexdigest()[
        :16
    ]


def baseline_folder(config: RunConfig) -> Path:
    return Path(config.results) / ".baselines" / baseline_key(config)


def load_or_make_baseline(pipe, config: RunConfig, hw, log: Log, made=None) -> np.ndarray:
    """The single-device images for this model, sampler and prompts: from the cache, else made
    now (or taken from `made`, the run's own single-device output) and cached atomically."""
    folder = baseline_folder(config)
    if (folder / "images.npy").is_file():
        return np.load(folder / "images.npy")
    if made is None:
        log("  single-device baseline: generating (cached for later runs)")
        made = generate_all(pipe, config, None, hw)
    images, latents = made
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    np.save(tmp / "images.npy", images)
    np.save(tmp / "latents.npy", latents)
    (tmp / "key.json").write_text(json.dumps(_baseline_id(config), indent=2))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return np.load(folder / "images.npy")


# ---------------------------------------------------------------------------- measuring


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


def cached_features(path: Path, images_fn) -> np.ndarray:
    """InceptionV3 features of a reference set, computed once and kept at `path`."""
    from patchpar.measure.features import inception_features

    if path.is_file():
        return np.load(path)
    feats = inception_features(images_fn())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex[:6]}.npy")
    np.save(tmp, feats)
    os.replace(tmp, path)
    return feats


def model_folder(name: str) -> Path:
    from patchpar.models.presets import PRESETS, SHIPPED, preset_folder

    return preset_folder(name) if name in PRESETS or name in SHIPPED else Path(name)


def ground_truth_features(config: RunConfig) -> np.ndarray:
    """Features of measure.ground_truth (its first ground_truth_samples images), cached."""
    from patchpar.datasets import ground_truth

    m = config.measure
    name = hashlib.sha256(f"{m.ground_truth}|{m.ground_truth_samples}".encode()).hexdigest()[:12]
    path = Path(config.results) / ".baselines" / f"ground-truth-{name}.npy"
    return cached_features(path, lambda: ground_truth(m.ground_truth, m.ground_truth_samples))


def quality_metrics(config: RunConfig, images: np.ndarray, ref: np.ndarray, log: Log) -> dict:
    """The metrics named in measure.quality, with the sample counts they used."""
    from patchpar.measure import quality as q

    m = config.measure
    out = q.paired(images, ref, m.quality, m.lpips_net)
    out["quality_samples"] = len(images)
    wanted = [k for k in ("fid", "fid_gt") if k in m.quality]
    if wanted:
        from patchpar.measure.features import inception_features

        log(f"  InceptionV3 features of {len(images)} images")
        got = q.guarded("features", lambda: inception_features(images))
        feats = got["features"]
        refs = {
            "fid": lambda: cached_features(baseline_folder(config) / "inception.npy", lambda: ref),
            "fid_gt": lambda: ground_truth_features(config),
        }
        for k in wanted:
            if feats is None:  # no extractor here: every FID says why
                out.update({k: None, f"{k}_unavailable": got["features_unavailable"]})
                continue
            got_ref = q.guarded("reference", refs[k])
            reference = got_ref["reference"]
            if reference is None:  # e.g. the ground truth is absent: say why
                out.update({k: None, f"{k}_unavailable": got_ref["reference_unavailable"]})
                continue
            out[k] = q.fid(feats, reference)
            if k == "fid_gt":
                out["fid_gt_reference_samples"] = len(reference)
    if "prompt_accuracy" in m.quality:
        from patchpar.measure.classifier import prompt_accuracy_by_class

        prompts = [p for b in _batches(config) for p, _ in b]
        folder = model_folder(config.model.name) / "classifier"
        if folder.is_dir():
            acc, per_class, counts = prompt_accuracy_by_class(folder, images, prompts)
            out["prompt_accuracy"] = acc
            out["prompt_accuracy_per_class"] = per_class
            out["predicted_class_counts"] = counts
        else:
            out["prompt_accuracy"] = None
            out["prompt_accuracy_unavailable"] = f"the model has no classifier at {folder}"
    if "clip_score" in m.quality:
        prompts = [p for b in _batches(config) for p, _ in b]
        out.update(
            q.guarded("clip_score", lambda: q.clip_score(
                images, prompts, m.clip_model, m.clip_checkpoint, m.clip_config))
        )  # fmt: skip
    return out


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
    hw = _image_size(pipe, config)
    pipe.check_size(*hw)
    f = pipe.latent_factor
    plan.validate(pipe.unet, (hw[0] // f, hw[1] // f), s.steps, s.guidance_scale)
    metrics["height"], metrics["width"] = hw
    metrics["strategy"] = plan.strategy.describe()
    metrics["sync_steps"] = plan.strategy.sync_steps(s.steps) if plan.strategy.parallel else s.steps

    images, latents = [], []
    for i, batch in enumerate(_batches(config)):
        cond, x0 = _inputs(pipe, config, batch, hw)
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
        seeds = [seed for b in _batches(config) for _, seed in b]
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
        record.update(
            status="error", error=f"invalid config: {invalid}", metrics={}, images=[]
        )
        return append_record(out, record)
    log(f"run {run_id}: {config.strategy.label()} on {config.mesh.devices} device(s)")
    try:
        metrics, images = _execute(config, out.parent / "images" / run_id, log)
        record.update(status="ok", error=None, metrics=metrics, images=images)
    except Exception as e:  # a failed point is a row with its status (DESIGN.md §7)
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
