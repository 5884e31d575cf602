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

        prompts = [p for b in batches(config) for p, _ in b]
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
        prompts = [p for b in batches(config) for p, _ in b]
        out.update(
            q.guarded("clip_score", lambda: q.clip_score(
                images, prompts, m.clip_model, m.clip_checkpoint, m.clip_config))
        )  # fmt: skip
    return out
