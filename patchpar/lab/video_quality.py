"""The quality of a run's videos ((N, T, H, W, 3) uint8), where it differs from an image's: the
paired metrics by frame index, each frame against its clip's previous one, and the measures of
`patchpar.measure.motion` (the item's class in every frame, its tracked motion, what that motion
does not explain). `lab.evaluate` calls these for a video model; the metric names are
`measure_config.VIDEO_METRICS`."""

from __future__ import annotations

import numpy as np

from patchpar.measure.quality import paired, psnr_per_image, sem


def frames_of(videos: np.ndarray) -> np.ndarray:
    """(N x T, H, W, C): every frame of every clip, clip after clip."""
    return videos.reshape(-1, *videos.shape[2:])


def psnr_by_frame(videos: np.ndarray, reference: np.ndarray) -> list[float | None]:
    """PSNR of frame t against the reference's frame t, the mean over the clips whose frame t
    differs (None where none does), for every t: where along the clip an error grows."""
    per = psnr_per_image(frames_of(videos), frames_of(reference)).reshape(videos.shape[:2])
    out = []
    for column in per.T:
        finite = column[np.isfinite(column)]
        out.append(float(finite.mean()) if len(finite) else None)
    return out


def prev_frame(videos: np.ndarray) -> dict:
    """PSNR and SSIM of every frame after the first against the frame before it, the mean over
    frames and clips: how much a clip changes from frame to frame (compare with single's)."""
    got = paired(frames_of(videos[:, 1:]), frames_of(videos[:, :-1]), ("psnr", "ssim"))
    return {"prev_frame_psnr": got["psnr"], "prev_frame_ssim": got["ssim"]}


def motion_metrics(videos: np.ndarray, prompts: list[str], wanted) -> dict:
    """motion_accuracy (the share of clips whose tracked motion is the prompt's, with its
    standard error and its share per motion) and temporal_error (the mean over clips)."""
    from patchpar.lab.clips import MOTIONS, parse_prompt
    from patchpar.measure.motion import classify_motion, temporal_error

    out: dict = {}
    if "motion_accuracy" in wanted:
        want = np.array([parse_prompt(p)[1] for p in prompts])
        got = np.array([classify_motion(v) for v in videos])
        acc = float((got == want).mean())
        out["motion_accuracy"] = acc
        out["motion_accuracy_sem"] = float(np.sqrt(acc * (1 - acc) / len(videos)))
        out["motion_accuracy_by_motion"] = {
            MOTIONS[m]: float((got[want == m] == m).mean()) for m in np.unique(want)
        }
    if "temporal_error" in wanted:
        errors = [temporal_error(v) for v in videos]
        out["temporal_error"] = float(np.mean(errors))
        out["temporal_error_sem"] = sem(np.asarray(errors))
    return out


def item_crops_of(videos: np.ndarray) -> np.ndarray:
    """(N x T, 28, 28): every frame's item cut out at the classifier's size (`item_crops`)."""
    from patchpar.measure.motion import item_crops

    return np.concatenate([item_crops(v) for v in videos])
