"""What a run measures (`RunConfig.measure`): timing repeats, bytes, and the quality metrics
that `patchpar.lab.evaluate` computes."""

from __future__ import annotations

from dataclasses import dataclass

VIDEO_METRICS = ("prev_frame", "motion_accuracy", "temporal_error")  # a video model's alone
QUALITY_METRICS = ("psnr", "ssim", "lpips", "fid", "fid_gt", "clip_score", "prompt_accuracy",
                   *VIDEO_METRICS)  # fmt: skip


@dataclass(frozen=True)
class MeasureConfig:
    warmup_runs: int = 1
    """Untimed runs after compilation, before the timed repeats."""
    repeats: int = 3
    """Timed runs (block_until_ready); the record keeps the median, min, max and all."""
    comm: bool = True
    """Count bytes per device and FLOPs from the lowered step programs (patchpar comm)."""
    quality: tuple[str, ...] = ("psnr", "ssim")
    """psnr, ssim, lpips (vs the single-device image of the same prompt and seed; DistriFusion
    Table 1), fid (vs the single-device set), fid_gt (vs ground_truth), clip_score (vs prompts),
    prompt_accuracy (the model folder's classifier/ agrees with the class the prompt names).
    A video's are frame by frame (the class of every frame's item), and a video model adds
    prev_frame (PSNR and SSIM of each frame against the one before), motion_accuracy (the item's
    tracked motion is the prompt's) and temporal_error (what that motion does not explain);
    `patchpar.measure.motion`."""
    ground_truth: str = "fashion-mnist"
    """fid_gt's reference: fashion-mnist[:train|:test] (padded 28 -> 32 as the fmnist model's
    frame), fmnist-clips[:train|:test] (the frames of `lab.clips`' clips: fmnist-video's) or a
    folder of images."""
    ground_truth_samples: int = 1000
    """How many ground-truth images fid_gt uses (their features are cached)."""
    clip_model: str | None = None
    """clip_score: a shipped CLIP (fmnist-clip), a folder in open_clip's local-dir format
    (open_clip_config.json + open_clip_model.safetensors), or an open_clip model name with
    clip_checkpoint; unset: the model's default (fmnist, fmnist-random: fmnist-clip)."""
    clip_checkpoint: str | None = None
    """clip_score: a local checkpoint file of a named open_clip model (nothing is downloaded)."""
    clip_config: str | None = None
    """clip_score: a model config JSON named <clip_model>.json, for models open_clip lacks."""
    lpips_net: str = "alex"
    """LPIPS backbone: alex, vgg or squeeze (its torchvision weights must be on disk)."""
    save_images: bool = True
    """Write the images next to the record (git-ignored)."""
    compute_only: bool = False
    """Replace every collective by a local stand-in of the same shape: the images are wrong
    (quality and bytes are not measured), the time is each device's compute alone
    (DistriFusion Table 2's "no communication (ideal)" row; experiments/speedup_breakdown.py)."""
