"""Ground-truth images, read from local files only: Fashion-MNIST (Debian's
`dataset-fashion-mnist`, installed by `make setup` where absent) and any folder of images."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_FILES = {"train": "train", "test": "t10k"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def fashion_mnist_dir() -> Path:
    return Path(os.environ.get("PATCHPAR_FASHION_MNIST", FASHION_MNIST_DIR))


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzipped): magic (2 zero bytes, dtype 0x08 = uint8, ndim), big-endian dims."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    if data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path}: not an IDX file of uint8")
    ndim = data[3]
    dims = np.frombuffer(data[4 : 4 + 4 * ndim], ">u4").astype(int)
    return np.frombuffer(data[4 + 4 * ndim :], np.uint8).reshape(dims)


def fashion_mnist(split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 28, 28) uint8, labels (N,) int) of the `train` (60,000) or `test` (10,000)
    split. Class names: FASHION_MNIST_CLASSES[label]."""
    if split not in _FILES:
        raise ValueError(f"split={split!r}; known: {list(_FILES)}")
    root = fashion_mnist_dir()
    images = root / f"{_FILES[split]}-images-idx3-ubyte.gz"
    labels = root / f"{_FILES[split]}-labels-idx1-ubyte.gz"
    for p in (images, labels):
        if not p.is_file():
            raise FileNotFoundError(
                f"Fashion-MNIST file {p} not found: install Debian's package with "
                f"`apt-get install dataset-fashion-mnist` (make setup does), or point "
                f"PATCHPAR_FASHION_MNIST at a folder with the four *-ubyte.gz files"
            )
    x, y = _read_idx(images), _read_idx(labels).astype(np.int64)
    if len(x) != len(y):
        raise ValueError(f"{root}: {len(x)} images but {len(y)} labels")
    return x, y


def to_rgb(images: np.ndarray) -> np.ndarray:
    """(N, H, W) or (N, H, W, 1|3) uint8 -> (N, H, W, 3)."""
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected grey or RGB images, got shape {images.shape}")
    return images


def load_image_folder(path: str | Path, limit: int | None = None) -> np.ndarray:
    """Every image in a folder (sorted by name) as (N, H, W, 3) uint8; all must share a size."""
    from PIL import Image

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"image folder {str(folder)!r} does not exist")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {str(folder)!r}")
    images = [np.asarray(Image.open(p).convert("RGB")) for p in files[:limit]]
    sizes = {im.shape for im in images}
    if len(sizes) > 1:
        raise ValueError(f"images in {str(folder)!r} differ in size: {sorted(sizes)}")
    return np.stack(images)


def pad32(images: np.ndarray) -> np.ndarray:
    """(N, 28, 28) Fashion-MNIST -> (N, 32, 32), centred on background: the frame the `fmnist`
    model was trained on (experiments/train_fmnist.py) and fmnist-clip sees."""
    return np.pad(images, ((0, 0), (2, 2), (2, 2)))


def check_ground_truth(spec: str) -> None:
    """ValueError, before any image is generated, when `spec` names no readable reference:
    an unknown Fashion-MNIST split, its files absent, or a folder without images."""
    if spec.startswith(("fashion-mnist", "fmnist-clips")):
        split = spec.split(":", 1)[1] if ":" in spec else "test"
        if split not in _FILES:
            raise ValueError(
                f"measure.ground_truth={spec!r}: unknown split {split!r}; use "
                f"fashion-mnist[:test|:train], fmnist-clips[:test|:train] or a folder of images"
            )
        for kind in ("images-idx3", "labels-idx1"):
            path = fashion_mnist_dir() / f"{_FILES[split]}-{kind}-ubyte.gz"
            if not path.is_file():
                raise ValueError(
                    f"measure.ground_truth={spec!r}: {path} not found; install Debian's "
                    f"dataset-fashion-mnist (make setup does) or point PATCHPAR_FASHION_MNIST "
                    f"at a folder with the four *-ubyte.gz files"
                )
        return
    folder = Path(spec)
    if not folder.is_dir():
        raise ValueError(
            f"measure.ground_truth={spec!r}: no such folder; give a folder of images "
            f"({', '.join(IMAGE_SUFFIXES)}), fashion-mnist[:test|:train] or "
            f"fmnist-clips[:test|:train]"
        )
    if not any(p.suffix.lower() in IMAGE_SUFFIXES for p in folder.iterdir()):
        raise ValueError(
            f"measure.ground_truth={spec!r}: the folder holds no images ({', '.join(IMAGE_SUFFIXES)})"
        )


def ground_truth(spec: str, limit: int | None = None) -> np.ndarray:
    """Reference images for FID: `fashion-mnist` / `fashion-mnist:train` (padded to 32x32 as
    the fmnist model's images), `fmnist-clips[:train]` (the frames of `lab.clips`' clips of
    that split, seed 0: fmnist-video's frames) or a folder path."""
    if spec.startswith("fmnist-clips"):
        from patchpar.lab.clips import FRAMES, clips

        split = spec.split(":", 1)[1] if ":" in spec else "test"
        n = -(-(limit or 10_000) // FRAMES)  # clips enough for `limit` frames
        x = clips(split, n, seed=0)[0]
        return to_rgb(x.reshape(-1, *x.shape[2:])[:limit])
    if spec.startswith("fashion-mnist"):
        split = spec.split(":", 1)[1] if ":" in spec else "test"
        images, _ = fashion_mnist(split)
        return to_rgb(pad32(images[:limit]))
    return load_image_folder(spec, limit)
