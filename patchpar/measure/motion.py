"""Offline measures of a clip's motion (`lab/clips.py`'s clips, or a model's videos of them): the
item tracked frame by frame (its intensity-weighted centroid and its extent), the motion that
track shows (`classify_motion`: the clip vocabulary's direction or zoom), the temporal
consistency of the frames once the tracked motion is undone (`temporal_error`), and each
frame's item cut out at the classifier's 28 x 28 (`item_crops`: the class measured frame by
frame, `measure.classifier.predict`)."""

from __future__ import annotations

import numpy as np

THRESHOLD = 0.2  # of the frame's brightest pixel: what counts as the item
ZOOM_LOG_AREA = 0.6  # |log(last area / first area)| above this is a zoom (the clips': 1.39)


def _frames(clip: np.ndarray) -> np.ndarray:
    """(F, H, W) float in [0, 1] of a (F, H, W[, C]) clip (uint8, or float in [-1, 1])."""
    x = np.asarray(clip)
    # the scale by the dtype given, before a mean over channels makes any clip float
    x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else (x.astype(np.float32) + 1) / 2
    if x.ndim == 4:
        x = x.mean(-1)
    if x.ndim != 3:
        raise ValueError(f"a clip is (F, H, W) or (F, H, W, C); got shape {x.shape}")
    return np.clip(x, 0.0, 1.0)


def track(clip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(centroids (F, 2) as (row, column), areas (F,) in pixels): each frame's item, the pixels
    at or above THRESHOLD of the frame's brightest, weighted by intensity."""
    x = _frames(clip)
    f, h, w = x.shape
    rows, cols = np.mgrid[0:h, 0:w]
    centroids, areas = np.zeros((f, 2)), np.zeros(f)
    for i, frame in enumerate(x):
        mask = frame >= THRESHOLD * max(float(frame.max()), 1e-6)
        weight = np.where(mask, frame, 0.0)
        total = max(float(weight.sum()), 1e-6)
        centroids[i] = (float((weight * rows).sum()) / total, float((weight * cols).sum()) / total)
        areas[i] = float(mask.sum())
    return centroids, areas


def classify_motion(clip: np.ndarray) -> int:
    """The index in `lab.clips.MOTIONS` the track shows: a zoom where the item's area grows or
    shrinks by more than e^ZOOM_LOG_AREA from the first to the last frame, else the direction
    of the centroid's larger displacement (a line fitted over the frames)."""
    centroids, areas = track(clip)
    grow = np.log(max(areas[-1], 1.0) / max(areas[0], 1.0))
    if abs(grow) > ZOOM_LOG_AREA:
        return 4 if grow > 0 else 5
    t = np.arange(len(centroids)) - (len(centroids) - 1) / 2
    dy, dx = (t @ (centroids - centroids.mean(0))) / (t @ t)  # pixels a frame
    if abs(dx) >= abs(dy):
        return 1 if dx > 0 else 0
    return 3 if dy > 0 else 2


def motion_accuracy(clips: np.ndarray, motions) -> float:
    """The share of clips whose tracked motion is the one asked for."""
    got = np.array([classify_motion(c) for c in clips])
    return float((got == np.asarray(motions)).mean())


def temporal_error(clip: np.ndarray) -> float:
    """Mean absolute difference (in [0, 1] units) between each frame and the one before it
    moved and scaled as the track says (about the item's centroid): what the motion does not
    explain. 0 for a clip that is its first frame carried along its track."""
    from scipy.ndimage import affine_transform

    x = _frames(clip)
    centroids, areas = track(clip)
    errs = []
    for i in range(1, len(x)):
        scale = np.sqrt(max(areas[i], 1.0) / max(areas[i - 1], 1.0))
        # output pixel p of the warped frame reads the previous frame at c0 + (p - c1) / scale
        matrix = np.eye(2) / scale
        offset = centroids[i - 1] - centroids[i] / scale
        warped = affine_transform(x[i - 1], matrix, offset=offset, order=1, mode="constant")
        errs.append(float(np.abs(warped - x[i]).mean()))
    return float(np.mean(errs))


def item_crops(clip: np.ndarray) -> np.ndarray:
    """(F, 28, 28) uint8: each frame's item, the square about its centroid whose side is the
    item's extent (the mask's larger side, at least 8 pixels), resized to 28 x 28 with a
    2-pixel margin as Fashion-MNIST's items have."""
    from PIL import Image

    x = _frames(clip)
    centroids, _ = track(clip)
    out = np.zeros((len(x), 28, 28), np.uint8)
    for i, frame in enumerate(x):
        ys, xs = np.nonzero(frame >= THRESHOLD * max(float(frame.max()), 1e-6))
        side = max(8, int(ys.max() - ys.min() + 1), int(xs.max() - xs.min() + 1)) if len(ys) else 8
        half = side / 2
        cy, cx = centroids[i]
        top, left = int(round(cy - half)), int(round(cx - half))
        pad = np.pad(frame, side)  # a crop past the canvas reads black
        crop = pad[top + side : top + 2 * side, left + side : left + 2 * side]
        img = Image.fromarray(np.round(crop * 255).astype(np.uint8)).resize((24, 24),
                                                                            Image.Resampling.LANCZOS)  # fmt: skip
        out[i, 2:26, 2:26] = np.asarray(img)
    return out
