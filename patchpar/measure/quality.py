"""Image quality against a reference set (the single-device outputs of the same prompts and
seeds). Images are uint8 (N, H, W, 3); metrics work on [0, 1].

PSNR is per image, then averaged over images (DistriFusion's definition); identical images
have infinite PSNR, and so has the mean: a record stores null with the count of identical
images. SSIM is torchmetrics'
(Gaussian window 11, sigma 1.5), imported only when asked for: the core library runs without
torch, and then SSIM is `unavailable` with the reason.
"""

from __future__ import annotations

import numpy as np


def _unit(images: np.ndarray) -> np.ndarray:
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"images must be uint8 (N, H, W, C), got {images.dtype} {images.shape}")
    return images.astype(np.float64) / 255.0


def _check_pair(a: np.ndarray, b: np.ndarray) -> None:
    if np.shape(a) != np.shape(b):
        raise ValueError(f"image sets differ in shape: {np.shape(a)} vs {np.shape(b)}")


def psnr_per_image(images: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """PSNR in dB of each image on [0, 1] (inf where identical)."""
    _check_pair(images, reference)
    mse = ((_unit(images) - _unit(reference)) ** 2).reshape(len(images), -1).mean(axis=1)
    with np.errstate(divide="ignore"):
        return 10.0 * np.log10(1.0 / mse)


def ssim(images: np.ndarray, reference: np.ndarray) -> float:
    """Mean SSIM over images (torchmetrics, data range 1)."""
    _check_pair(images, reference)
    import torch
    from torchmetrics.functional.image import structural_similarity_index_measure

    to_t = lambda a: torch.from_numpy(_unit(a)).permute(0, 3, 1, 2)  # noqa: E731  (N, C, H, W)
    return float(structural_similarity_index_measure(to_t(images), to_t(reference), data_range=1.0))


def compare(images: np.ndarray, reference: np.ndarray, metrics: tuple[str, ...]) -> dict:
    """The metrics named, for a record. Metrics that cannot run here say why."""
    out: dict = {}
    if "psnr" in metrics:
        per = psnr_per_image(images, reference)
        same = int(np.isinf(per).sum())
        # an identical image has PSNR inf, and so has the mean: stored as null, with the count
        out["psnr"] = None if same else float(per.mean())
        out["psnr_identical_images"] = same
        out["identical"] = same == len(per)
    if "ssim" in metrics:
        try:
            out["ssim"] = ssim(images, reference)
        except ImportError as e:
            out["ssim"] = None
            out["ssim_unavailable"] = f"needs torch and torchmetrics ({e})"
    return out
