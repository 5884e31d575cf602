"""Quality of a run's images: the metrics `measure.quality` names, against the single-device
baseline (paired PSNR/SSIM/LPIPS, FID), the ground truth (FID), the prompts (CLIP score) or
the model's classifier (prompt accuracy), with the sample counts used. The metric maths is in
`patchpar.measure.quality`; this module picks references and caches their features."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from patchpar.lab.baselines import baseline_folder, model_folder
from patchpar.lab.config import RunConfig
from patchpar.lab.generation import batches

Log = Callable[[str], None]


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


def ground_truth_features(config: RunConfig) -> np.ndarray:
    """Features of measure.ground_truth (its first ground_truth_samples images), cached."""
    from patchpar.lab.datasets import ground_truth

    m = config.measure
    name = hashlib.sha256(
        f"{m.ground_truth}|{m.ground_truth_samples}|fashion-mnist padded to 32".encode()
    ).hexdigest()[:12]
    path = Path(config.results) / ".baselines" / f"ground-truth-{name}.npy"
    return cached_features(path, lambda: ground_truth(m.ground_truth, m.ground_truth_samples))


def clip_spec(config: RunConfig) -> tuple[str, str | None, str | None]:
    """(model, checkpoint, config JSON) of the CLIP that clip_score uses: measure.clip_model,
    a shipped name resolved to its folder, or the run's model's default."""
    from patchpar.lab.defaults import DEFAULT_CLIP
    from patchpar.models.presets import CLIP_MODELS

    m = config.measure
    name = m.clip_model if m.clip_model is not None else DEFAULT_CLIP.get(config.model.name)
    if name is None:
        raise ValueError(
            f"measure.clip_model is unset and model {config.model.name!r} has no default CLIP "
            f"(models with one: {sorted(DEFAULT_CLIP)}); name one of {sorted(CLIP_MODELS)} or "
            f"a folder with open_clip_config.json"
        )
    if name in CLIP_MODELS:
        return str(CLIP_MODELS[name]), None, None
    return name, m.clip_checkpoint, m.clip_config


def classifier_folder(config: RunConfig) -> Path:
    """The prompt_accuracy classifier: the model folder's classifier/ (fmnist-random: fmnist's)."""
    from patchpar.lab.defaults import CLASSIFIER_OF

    name = config.model.name
    return model_folder(CLASSIFIER_OF.get(name, name)) / "classifier"


def prompts_of(config: RunConfig) -> list[str]:
    """The prompt of each image, in the order the run makes them."""
    return [p for b in batches(config) for p, _ in b]


def check_quality_inputs(config: RunConfig) -> None:
    """What the quality metrics need, checked before anything is generated: prompt_accuracy
    needs the model's classifier and a class named in every prompt; clip_score a CLIP that
    loads (its checkpoint matching its config); fid_gt a readable ground truth; motion_accuracy
    prompts of fmnist-video's vocabulary."""
    m = config.measure
    if "fid_gt" in m.quality:
        from patchpar.lab.datasets import check_ground_truth

        check_ground_truth(m.ground_truth)
    if "prompt_accuracy" in m.quality:
        from patchpar.measure.classifier import prompt_class

        folder = classifier_folder(config)
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"measure.quality has prompt_accuracy but model {config.model.name!r} has no "
                f"classifier at {folder}; drop prompt_accuracy or use a model with one (fmnist)"
            )
        for p in dict.fromkeys(prompts_of(config)):
            prompt_class(p)  # ValueError naming the prompt and the classes
    if "motion_accuracy" in m.quality:
        from patchpar.lab.clips import parse_prompt

        for p in dict.fromkeys(prompts_of(config)):
            parse_prompt(p)  # ValueError naming the nearest known motion or class
    if "clip_score" in m.quality:
        from patchpar.measure.features import clip

        clip(*clip_spec(config))  # loads once per process; a mismatch is a ValueError here


def quality_metrics(config: RunConfig, images: np.ndarray, ref: np.ndarray, log: Log) -> dict:
    """The metrics named in measure.quality, with the sample counts they used. Videos
    ((N, T, H, W, 3)) are measured frame by frame, with a video's own measures
    (`lab.video_quality`)."""
    from patchpar.lab import video_quality as vq
    from patchpar.measure import quality as q

    m = config.measure
    prompts, out, videos = prompts_of(config), {}, None
    if images.ndim == 5:  # videos: their frames from here on, and the video measures
        videos = images
        images, ref = vq.frames_of(videos), vq.frames_of(ref)
        prompts = [p for p in prompts for _ in range(videos.shape[1])]
        if "psnr" in m.quality:
            out["psnr_by_frame"] = vq.psnr_by_frame(videos, ref.reshape(videos.shape))
        if "prev_frame" in m.quality:
            out.update(vq.prev_frame(videos))
        out.update(vq.motion_metrics(videos, prompts_of(config), m.quality))
        out["quality_frames"] = len(images)
    out = {**q.paired(images, ref, m.quality, m.lpips_net), **out}
    out["quality_samples"] = len(prompts_of(config))
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
            out[f"{k}_reference"] = "single-device outputs" if k == "fid" else m.ground_truth
            out[f"{k}_reference_samples"] = len(reference)
            if min(len(feats), len(reference)) < q.FID_RELIABLE_SAMPLES:
                out[f"{k}_biased"] = (
                    f"{min(len(feats), len(reference))} samples < {q.FID_RELIABLE_SAMPLES} (the "
                    f"feature dimension): biased upwards, compare only at equal sample counts"
                )
    if "prompt_accuracy" in m.quality:  # the classifier's presence checked before generating
        from patchpar.measure.classifier import prompt_accuracy_by_class

        folder = classifier_folder(config)
        shown = images if videos is None else vq.item_crops_of(videos)  # a video: each item
        acc, per_class, counts = prompt_accuracy_by_class(folder, shown, prompts)
        out["prompt_accuracy"] = acc
        # a video's frames are far from independent draws: its standard error counts clips
        out["prompt_accuracy_sem"] = float(np.sqrt(acc * (1 - acc) / len(prompts_of(config))))
        out["prompt_accuracy_per_class"] = per_class
        out["predicted_class_counts"] = counts
    if "clip_score" in m.quality:
        model, checkpoint, clip_config = clip_spec(config)
        got = q.guarded("cos", lambda: q.clip_cosines(
            images, prompts, model, checkpoint, clip_config))  # fmt: skip
        if got["cos"] is None:
            out.update(clip_score=None, clip_score_unavailable=got["cos_unavailable"])
        else:
            out["clip_score"] = q.clip_score_of(got["cos"])
            out["clip_score_sem"] = q.sem(got["cos"])
            out["clip_model"] = m.clip_model or model.rsplit("/", 1)[-1]
    return out
