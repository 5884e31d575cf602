"""The published row of a `fmnist-video` model: its clips' class and motion accuracy on held-out
seeds, their temporal error, and FID of their frames, beside the same measures of ground-truth
test clips.

    .venv/bin/python experiments/eval_fmnist_video.py --model runs/train_fmnist_video/weights

Every (class, motion) caption (60) is sampled `--per-caption` times on one device, from seeds
1000, 1001, ... (training never saw a seed: it draws its noise from its own key); each video's
frames are measured by `patchpar/measure/motion.py`: the class of every frame's item
(`item_crops` and the model's classifier/, else fmnist's), the motion its track shows
(`classify_motion`), the frames' error once the tracked motion is undone (`temporal_error`);
with `--fid`, InceptionV3 FID of all generated frames against as many ground-truth test
frames. Writes <out>/records.jsonl (one record per run) and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from patchpar.lab.clips import MOTIONS, caption, clips, parse_prompt
from patchpar.lab.results import append_record, provenance
from patchpar.lab.video_quality import item_crops_of, motion_metrics
from patchpar.measure.classifier import FASHION_MNIST_CLASSES, predict
from patchpar.models.presets import SHIPPED


def classifier_of(model: str) -> Path:
    """The model folder's classifier/ (the trained fmnist-video's), else fmnist's."""
    own = Path(SHIPPED.get(model, model)) / "classifier"
    return own if own.is_dir() else SHIPPED["fmnist"] / "classifier"


def measures(videos: np.ndarray, prompts: list[str], classifier: Path) -> dict:
    """Class accuracy over every frame, and `lab.video_quality.motion_metrics` (motion accuracy,
    per motion, temporal error), of (N, F, H, W[, C]) uint8 videos made for `prompts`."""
    labels = np.array([parse_prompt(p)[0] for p in prompts])
    got = predict(classifier, item_crops_of(videos)).reshape(len(videos), -1)
    return {
        "class_accuracy": float((got == labels[:, None]).mean()),
        **motion_metrics(videos, prompts, ("motion_accuracy", "temporal_error")),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="fmnist-video", help="a preset or folder")
    ap.add_argument("--per-caption", type=int, default=2, help="videos of each caption")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance-scale", type=float, default=5.0)
    ap.add_argument(
        "--first-seed",
        type=int,
        default=1000,
        help="seeds from here (held out; the sampler's settings chosen on others)",
    )
    ap.add_argument("--fid", action="store_true", help="also FID of the frames (InceptionV3)")
    ap.add_argument("--out", type=Path, default=Path("runs/eval_fmnist_video"))
    args = ap.parse_args(argv)

    from patchpar.pipelines import load_pipeline

    pipe = load_pipeline(args.model)
    caps = [caption(c, m) for c in range(len(FASHION_MNIST_CLASSES)) for m in range(len(MOTIONS))]
    videos, prompts = [], []
    t0 = time.perf_counter()
    for r in tqdm(range(args.per_caption), desc="fmnist-video eval", unit="round"):
        out = pipe(
            caps, steps=args.steps, guidance_scale=args.guidance_scale, seed=args.first_seed + r
        )
        videos.append(out.frames)
        prompts += caps
    videos = np.concatenate(videos)
    classifier = classifier_of(args.model)
    trained = Path(SHIPPED.get(args.model, args.model)) / "training.json"
    info = json.loads(trained.read_text()) if trained.is_file() else {}
    record = {
        "model": str(args.model),
        "trained_steps": info.get("trained_steps"),
        "videos": len(videos),
        "steps": args.steps,
        "guidance_scale": args.guidance_scale,
        "seeds": [args.first_seed, args.first_seed + args.per_caption - 1],
        "sampler": pipe.default_sampler,
        "classifier": str(classifier),
        "generated": measures(videos, prompts, classifier),
        "sample_s": round(time.perf_counter() - t0, 1),
    }
    profile = info.get("recipe", {}).get("motion_profile", "constant")  # the training's pace
    gt, _, _, gt_prompts = clips("test", len(videos), seed=0, profile=profile)
    record["motion_profile"] = profile
    record["ground_truth"] = measures(gt, gt_prompts, classifier)
    if args.fid:
        from patchpar.lab.datasets import to_rgb
        from patchpar.measure.features import inception_features
        from patchpar.measure.quality import fid

        frames = videos.reshape(-1, *videos.shape[2:])
        reference = to_rgb(gt.reshape(-1, *gt.shape[2:]))
        record["fid_frames"] = fid(inception_features(frames), inception_features(reference))
    record["provenance"] = provenance()
    append_record(args.out / "records.jsonl", record)
    print({k: v for k, v in record.items() if k != "provenance"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
