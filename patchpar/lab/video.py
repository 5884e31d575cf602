"""A video's frames on disk: an animated GIF (Pillow) and a PNG grid of every frame."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

FPS = 16  # Wan's frame rate (diffusers' export_to_video examples for Wan)


def frame_grid(frames: np.ndarray, columns: int = 8) -> np.ndarray:
    """(T, H, W, 3) uint8 -> one (rows x H, columns x W, 3) image, frame after frame along
    each row, black where the last row is short."""
    t, h, w, c = frames.shape
    cols = min(columns, t)
    rows = math.ceil(t / cols)
    grid = np.zeros((rows * cols, h, w, c), frames.dtype)
    grid[:t] = frames
    return grid.reshape(rows, cols, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, cols * w, c)


def write_video(frames: np.ndarray, folder: Path, stem: str, fps: int = FPS) -> tuple[Path, Path]:
    """`<stem>.gif` (every frame, `fps` per second, looping) and `<stem>_frames.png` (the frame
    grid) in `folder`; the two paths. Written under a temporary name, then renamed."""
    from PIL import Image

    folder = Path(folder)
    images = [Image.fromarray(f) for f in frames]
    gif, png = folder / f"{stem}.gif", folder / f"{stem}_frames.png"
    tmp = folder / f"{stem}.gif.tmp"
    images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                   duration=round(1000 / fps), loop=0)  # fmt: skip
    tmp.replace(gif)
    tmp = folder / f"{stem}_frames.png.tmp"
    Image.fromarray(frame_grid(frames)).save(tmp, format="PNG")
    tmp.replace(png)
    return gif, png
