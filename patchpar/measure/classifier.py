"""`prompt_accuracy`: the share of generated images that a Fashion-MNIST classifier assigns to
the class their prompt names; the offline stand-in for a CLIP score on the `fmnist` model.

The classifier is a small CNN (Flax) trained by experiments/train_fmnist.py and kept in the
model folder under `classifier/` (config.json + model.safetensors)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

FASHION_MNIST_CLASSES = (
    "T-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)  # label k's name


class FashionCNN(nn.Module):
    """(N, 28, 28, 1) in [0, 1] -> (N, 10) logits."""

    width: int = 16

    @nn.compact
    def __call__(self, x):
        for mult in (1, 2):  # (N, 28, 28) -> (N, 14, 14) -> (N, 7, 7)
            x = nn.relu(nn.Conv(self.width * mult, (3, 3))(x))
            x = nn.relu(nn.Conv(self.width * mult, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
        return nn.Dense(len(FASHION_MNIST_CLASSES))(x)


def to_input(images: np.ndarray) -> jnp.ndarray:
    """uint8 (N, H, W) or (N, H, W, C) images -> (N, 28, 28, 1) grey in [0, 1]; 32x32 images
    (the fmnist model's, Fashion-MNIST padded by 2) are cropped, other sizes resized."""
    x = np.asarray(images, np.float32) / 255.0
    x = x[..., None] if x.ndim == 3 else x.mean(axis=-1, keepdims=True)
    h, w = x.shape[1:3]
    if (h, w) == (32, 32):
        x = x[:, 2:30, 2:30]
    elif (h, w) != (28, 28):
        x = np.asarray(jax.image.resize(x, (x.shape[0], 28, 28, 1), "bilinear"))
    return jnp.asarray(x)


def save(folder: Path, params, width: int, test_accuracy: float) -> None:
    from flax.traverse_util import flatten_dict
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # contiguous: safetensors writes an array's memory as it lies, and a TPU's arrays come back
    # to the host in their own layout (a classifier saved there read back as noise)
    flat = {"/".join(k): np.ascontiguousarray(v) for k, v in flatten_dict(params).items()}
    save_file(flat, str(folder / "model.safetensors"))
    config = {"architecture": "FashionCNN", "width": width, "classes": list(FASHION_MNIST_CLASSES)}
    config["test_accuracy"] = test_accuracy
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@functools.cache
def load(folder: str):
    """(apply, params) of the classifier in `folder` (a model folder's classifier/)."""
    from flax.traverse_util import unflatten_dict
    from safetensors.numpy import load_file

    folder = Path(folder)
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"no classifier at {folder} (config.json + model.safetensors)")
    config = json.loads((folder / "config.json").read_text())
    params = unflatten_dict(
        {tuple(k.split("/")): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    )
    module = FashionCNN(config["width"])
    return jax.jit(lambda p, x: module.apply({"params": p}, x)), params


def predict(folder: str | Path, images: np.ndarray, batch: int = 500) -> np.ndarray:
    apply, params = load(str(folder))
    x = to_input(images)
    return np.concatenate(
        [np.asarray(apply(params, x[i : i + batch]).argmax(-1)) for i in range(0, len(x), batch)]
    )


def prompt_class(prompt: str) -> int:
    """The Fashion-MNIST class a prompt names (the longest class name found, so "T-shirt" wins
    over "shirt"); ValueError when it names none."""
    found = [
        (len(name), k)
        for k, name in enumerate(FASHION_MNIST_CLASSES)
        if re.search(rf"(?<![\w-]){re.escape(name.lower())}(?![\w-])", prompt.lower())
    ]
    if not found:
        raise ValueError(
            f"prompt {prompt!r} names no Fashion-MNIST class ({list(FASHION_MNIST_CLASSES)})"
        )
    return max(found)[1]


def prompt_accuracy(folder: str | Path, images: np.ndarray, prompts: list[str]) -> float:
    """Share of images the classifier assigns to the class their prompt names."""
    return prompt_accuracy_by_class(folder, images, prompts)[0]


def prompt_accuracy_by_class(
    folder: str | Path, images: np.ndarray, prompts: list[str]
) -> tuple[float, dict[str, float], dict[str, int]]:
    """(overall share, share per prompted class, how many images the classifier put in each
    class), the classes by name; only prompted classes appear in the per-class shares."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts; one prompt per image")
    want = np.array([prompt_class(p) for p in prompts])
    got = predict(folder, images)
    per_class = {
        FASHION_MNIST_CLASSES[k]: float((got[want == k] == k).mean()) for k in np.unique(want)
    }
    counts = {name: int((got == k).sum()) for k, name in enumerate(FASHION_MNIST_CLASSES)}
    return float((got == want).mean()), per_class, counts
