"""Image quality: the metric maths. Feature extractors (InceptionV3, CLIP, the LPIPS backbone)
live in `features.py` and are imported only when a metric needs them, so the core library runs
without torch. Images are uint8 (N, H, W, 3).

- PSNR per image on [0, 1], then averaged over images (DistriFusion's definition). An identical
  image has infinite PSNR: the mean is taken over the other images and the record counts the
  identical ones (`psnr_identical_images`); null only when every image is identical.
- SSIM: torchmetrics (Gaussian window 11, sigma 1.5, data range 1), mean over images.
- LPIPS: torchmetrics with the AlexNet backbone, when its weights are on disk.
- FID: torchmetrics' FrechetInceptionDistance on features given (2048-d InceptionV3 pool
  features for images), so the features of a reference set are computed once and cached.
- CLIP score: max(mean over images of 100 cos(image, prompt), 0), torchmetrics' CLIPScore
  definition (the clamp is applied to the mean), with an open_clip model loaded from local
  files (the shipped fmnist-clip for fmnist runs).
- Spread: `<metric>_sem`, the standard error over images of the per-image values (PSNR, SSIM,
  CLIP score; prompt accuracy's binomial sqrt(p(1-p)/n)).
"""

from __future__ import annotations

import numpy as np

from patchpar.measure.availability import Unavailable, guarded

FID_MIN_SAMPLES = 2  # a covariance needs two samples
FID_RELIABLE_SAMPLES = 2048  # below the feature dimension the covariance is singular: FID is
# biased upwards by an amount that depends on the sample count, so compare only at equal counts
PAIRED = ("psnr", "ssim", "lpips")  # against the single-device image of the same prompt and seed
KNOWN = PAIRED + ("fid", "fid_gt", "clip_score")
__all__ = [
    "Unavailable",
    "guarded",
    "psnr_per_image",
    "ssim",
    "lpips",
    "fid",
    "clip_score",
    "paired",
]


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


def _nchw_unit(images: np.ndarray):
    import torch

    return torch.from_numpy(_unit(images)).permute(0, 3, 1, 2)


def sem(values) -> float | None:
    """Standard error of the mean over images (None for fewer than two)."""
    v = np.asarray(values, np.float64)
    return float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None


def ssim_per_image(images: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """SSIM of each image (torchmetrics, Gaussian window 11, sigma 1.5, data range 1)."""
    _check_pair(images, reference)
    from torchmetrics.functional.image import structural_similarity_index_measure

    return structural_similarity_index_measure(
        _nchw_unit(images), _nchw_unit(reference), data_range=1.0, reduction="none"
    ).numpy()


def ssim(images: np.ndarray, reference: np.ndarray) -> float:
    """Mean SSIM over images."""
    return float(ssim_per_image(images, reference).mean())


def lpips(images: np.ndarray, reference: np.ndarray, net: str = "alex") -> float:
    """Mean LPIPS over images; raises Unavailable without the backbone weights."""
    _check_pair(images, reference)
    import torch

    from patchpar.measure.features import lpips as lpips_model

    metric = lpips_model(net)
    metric.reset()
    with torch.no_grad():
        metric.update(_nchw_unit(images).float(), _nchw_unit(reference).float())
        return float(metric.compute())


def fid(features: np.ndarray, reference: np.ndarray) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets (N, D), by torchmetrics'
    FrechetInceptionDistance (float64 statistics)."""
    import torch
    from torchmetrics.image.fid import FrechetInceptionDistance

    a, b = np.asarray(features, np.float64), np.asarray(reference, np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"feature sets must be (N, D) with one D, got {a.shape} and {b.shape}")
    if min(len(a), len(b)) < 2:
        raise ValueError(f"FID needs at least 2 samples per set, got {len(a)} and {len(b)}")

    class Given(torch.nn.Module):  # the "images" handed to update() are the features
        num_features = a.shape[1]

        def forward(self, x):
            return x

    metric = FrechetInceptionDistance(feature=Given(), reset_real_features=True)
    metric.update(torch.from_numpy(b), real=True)
    metric.update(torch.from_numpy(a), real=False)
    return float(metric.compute())


def clip_cosines(
    images: np.ndarray,
    prompts: list[str],
    model: str,
    checkpoint: str | None = None,
    config: str | None = None,
    batch: int = 500,
) -> np.ndarray:
    """100 cos(image embedding, prompt embedding) of each image and its prompt."""
    import torch
    from PIL import Image

    from patchpar.measure.features import clip

    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts; one prompt per image")
    net, preprocess, tokenizer = clip(
        str(model),
        None if checkpoint is None else str(checkpoint),
        None if config is None else str(config),
    )
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch):
            x = torch.stack([preprocess(Image.fromarray(im)) for im in images[i : i + batch]])
            img = net.encode_image(x)
            txt = net.encode_text(tokenizer(list(prompts[i : i + batch])))
            out.append(100 * torch.nn.functional.cosine_similarity(img, txt, dim=-1))
    return torch.cat(out).double().numpy()


def clip_score_of(cosines: np.ndarray) -> float:
    """max(mean over images of 100 cos(image, prompt), 0), as torchmetrics' CLIPScore."""
    return max(float(np.mean(cosines)), 0.0)


def clip_score(
    images: np.ndarray,
    prompts: list[str],
    model: str,
    checkpoint: str | None = None,
    config: str | None = None,
) -> float:
    """The CLIP score of images against their prompts (clip_score_of their cosines)."""
    return clip_score_of(clip_cosines(images, prompts, model, checkpoint, config))


def paired(images: np.ndarray, reference: np.ndarray, metrics, lpips_net: str = "alex") -> dict:
    """PSNR / SSIM / LPIPS against the reference image of the same prompt and seed, for a
    record. A metric that cannot run here is null with `<name>_unavailable` saying why."""
    out: dict = {}
    if "psnr" in metrics:
        per = psnr_per_image(images, reference)
        finite = per[np.isfinite(per)]
        out["psnr"] = float(finite.mean()) if len(finite) else None  # over the differing images
        out["psnr_identical_images"] = len(per) - len(finite)
        out["identical"] = not len(finite)
        out["psnr_sem"] = sem(finite)
    if "ssim" in metrics:
        got = guarded("ssim", lambda: ssim_per_image(images, reference))
        per_ssim = got.pop("ssim")
        out.update(got)
        out["ssim"] = None if per_ssim is None else float(per_ssim.mean())
        out["ssim_sem"] = None if per_ssim is None else sem(per_ssim)
    if "lpips" in metrics:
        out.update(guarded("lpips", lambda: lpips(images, reference, lpips_net)))
    return out
