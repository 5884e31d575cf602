"""Short Fashion-MNIST clips for the `fmnist-video` model, made reproducibly from Debian's
Fashion-MNIST (`datasets.fashion_mnist`): one item on a black 32 x 32 canvas, 8 frames, moving
left, right, up or down by 14 pixels in all, or zooming in or out (its side 12 -> 24 pixels or
back), accelerating from rest (the default) or at a constant pace (`PROFILES`); the caption
names the class and the motion ("a sneaker moving left"). 8 frames split evenly over 2, 4 and
8 devices in every layout (frames, rows, 2 x 2 and 2 x 4 grids).

A clip is drawn from (split, index, seed) alone: the item is the split's image `index`, its
motion `index % len(MOTIONS)` (every motion equally often, each class in every motion), its
start and offset from `np.random.default_rng((seed, index))`."""

from __future__ import annotations

import difflib
import re

import numpy as np

from patchpar.measure.classifier import FASHION_MNIST_CLASSES

FRAMES = 8
SIZE = 32  # the canvas, pixels a side
ITEM = 16  # a moving item's side
STEP = 2  # pixels a frame at a constant pace (14 in all)
ZOOM = (12, 24)  # a zooming item's side, first -> last frame (zooming out: last -> first)
MOTIONS = ("moving left", "moving right", "moving up", "moving down", "zooming in", "zooming out")
PROFILES = ("accelerating", "constant")
"""How a clip's motion runs: from rest, the travel or zoom growing with the square of the time
(played backwards, no clip of the set: the frames' order shows in every clip), or at a
constant speed (a clip played backwards is the reversed motion's: the set has no arrow of time,
and a Wan, whose RoPE is relative, learns the motion's axis but not its direction;
results/fmnist_video_recipe)."""


def _progress(f: int, profile: str) -> float:
    """The share of the travel or zoom done by frame f."""
    frac = f / (FRAMES - 1)
    return frac if profile == "constant" else frac * frac


def caption(label: int, motion: int) -> str:
    """The caption of a class and a motion: "a sneaker moving left", "an ankle boot zooming
    in"."""
    name = FASHION_MNIST_CLASSES[label]
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name} {MOTIONS[motion]}"


def _resized(image: np.ndarray, side: int) -> np.ndarray:
    """A 28 x 28 uint8 image resized to side x side (float32 in [0, 1], antialiased)."""
    from PIL import Image

    img = Image.fromarray(image).resize((side, side), Image.Resampling.LANCZOS)
    return np.clip(np.asarray(img, np.float32) / 255.0, 0.0, 1.0)


def _paste(canvas: np.ndarray, item: np.ndarray, top: int, left: int) -> None:
    s = item.shape[0]
    canvas[top : top + s, left : left + s] = np.maximum(
        canvas[top : top + s, left : left + s], item
    )


def make_clip(
    image: np.ndarray, motion: int, rng: np.random.Generator, profile: str = "accelerating"
) -> np.ndarray:
    """(FRAMES, SIZE, SIZE) uint8: `image` (28 x 28) moving or zooming by `motion`, at the
    `profile`'s pace (PROFILES)."""
    if profile not in PROFILES:
        raise ValueError(f"motion profile {profile!r}; known: {list(PROFILES)}")
    clip = np.zeros((FRAMES, SIZE, SIZE), np.float32)
    travel = STEP * (FRAMES - 1)  # 14 pixels
    free = SIZE - ITEM  # 16 pixels of room
    if motion < 4:
        item = _resized(image, ITEM)
        across = int(rng.integers(0, free + 1))  # the other axis
        start = int(rng.integers(travel, free + 1))  # along the motion, from its far side
        sign = -1 if motion in (0, 2) else 1  # left and up decrease the coordinate
        start = start if sign < 0 else free - start
        for f in range(FRAMES):
            along = start + sign * round(travel * _progress(f, profile))
            top, left = (across, along) if motion < 2 else (along, across)
            _paste(clip[f], item, top, left)
    else:
        lo, hi = ZOOM
        half = hi // 2
        cy, cx = (int(v) for v in rng.integers(half, SIZE - half + 1, size=2))
        for f in range(FRAMES):
            done = _progress(f, profile)
            side = round(lo + (hi - lo) * done if motion == 4 else hi - (hi - lo) * done)
            _paste(clip[f], _resized(image, side), cy - side // 2, cx - side // 2)
    return np.round(clip * 255).astype(np.uint8)


def clips(split: str, count: int, seed: int = 0, start: int = 0, profile: str = "accelerating"):
    """(clips (N, FRAMES, SIZE, SIZE) uint8, labels (N,), motions (N,), captions) of the
    split's images start .. start + count (Fashion-MNIST's `train` or `test`), their motion at
    the `profile`'s pace."""
    from patchpar.lab.datasets import fashion_mnist

    images, labels = fashion_mnist(split)
    if start < 0 or count < 1 or start + count > len(images):
        raise ValueError(
            f"clips {start}..{start + count} of the {split} split: it has {len(images)} images "
            f"(start >= 0, count >= 1)"
        )
    idx = np.arange(start, start + count)
    motions = idx % len(MOTIONS)
    out = np.stack(
        [
            make_clip(images[i], int(m), np.random.default_rng((seed, int(i))), profile)
            for i, m in zip(idx, motions, strict=True)
        ]  # fmt: skip
    )
    caps = [caption(int(labels[i]), int(m)) for i, m in zip(idx, motions, strict=True)]
    return out, labels[idx], motions, caps


def parse_prompt(prompt: str) -> tuple[int, int]:
    """(class, motion) a prompt names ("a sneaker moving left"); ValueError naming the nearest
    known class or motion where one is not in the vocabulary."""
    text = re.sub(r"\s+", " ", prompt.strip().lower())
    motion = next((m for m, word in enumerate(MOTIONS) if text.endswith(word)), None)
    if motion is None:
        tail = " ".join(text.split()[-2:])
        near = difflib.get_close_matches(tail, MOTIONS, n=2, cutoff=0.0)
        raise ValueError(
            f"prompt {prompt!r}: no motion of fmnist-video's vocabulary ends it; nearest: "
            f"{near} (known: {list(MOTIONS)})"
        )
    name = text[: -len(MOTIONS[motion])].strip().removeprefix("a ").removeprefix("an ").strip()
    classes = [c.lower() for c in FASHION_MNIST_CLASSES]
    if name not in classes:
        near = difflib.get_close_matches(name, classes, n=2, cutoff=0.0)
        raise ValueError(
            f"prompt {prompt!r}: class {name!r} is not one of fmnist-video's; nearest: {near} "
            f"(known: {list(FASHION_MNIST_CLASSES)})"
        )
    return classes.index(name), motion
