"""A video model's latent as the denoiser takes it: the latent frames a frame count makes
(`latent_frames`) and the denoiser set on the video's layout with the tall latent it runs on
(`on_video`), checked against the patch devices; what a pipeline, a check or a lowering of a
video model asks before anything runs."""

from __future__ import annotations

import numpy as np

from patchpar.models.wan.model import Video


def latent_frames(frames, temporal: int = 4) -> int:
    """Latent frames of a video of `frames` frames under a VAE compressing time `temporal`x
    (the first frame alone, then `temporal` per latent frame); ValueError naming the nearest
    counts that fit (temporal k + 1)."""
    if isinstance(frames, bool) or not isinstance(frames, int | np.integer) or frames < 1:
        raise ValueError(f"frames={frames!r}: must be a positive integer of the form "
                         f"{temporal}k + 1 (1, {temporal + 1}, {2 * temporal + 1}, ...)")  # fmt: skip
    if (frames - 1) % temporal:
        k = (frames - 1) // temporal
        fit = [temporal * k + 1, temporal * (k + 1) + 1]
        raise ValueError(
            f"frames={frames}: the video VAE compresses time {temporal}x after the first frame, "
            f"so frames must be {temporal}k + 1; nearest that fit: {fit}"
        )
    return (frames - 1) // temporal + 1


def on_video(unet, frames: int, layout: str, temporal: int, frame_hw: tuple[int, int],
             patches: int | None = None):  # fmt: skip
    """(`unet` on the video of `frames` frames laid out by `layout`, the tall latent (rows, w))
    for a frame's latent `frame_hw`, under a VAE compressing time `temporal`x; ValueError where
    the frames do not fit the VAE or the layout does not cut the video into `patches` row
    patches (None: one device)."""
    video = Video(latent_frames(frames, temporal), layout)
    video.check(frame_hw[0] // unet.row_multiple, patches)
    return unet.with_video(video), (video.frames * frame_hw[0], frame_hw[1])
