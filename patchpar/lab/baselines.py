"""Single-device baselines: the `single` outputs of a model, sampler and prompt set, made once
and cached under `<results>/.baselines/<key>`; the key covers the config parts that decide the
images, the code's commit and the digest of the weights loaded (docs/design.md §6)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from patchpar.lab.config import RunConfig
from patchpar.lab.configio import to_dict
from patchpar.lab.generation import generate_all
from patchpar.lab.results import git_commit

Log = Callable[[str], None]


def model_folder(name: str) -> Path:
    from patchpar.models.presets import PRESETS, SHIPPED, preset_folder

    return preset_folder(name) if name in PRESETS or name in SHIPPED else Path(name)


def weights_sha256(config: RunConfig) -> str | None:
    """Digest of the model folder the run loads (None when it cannot be read: the run itself
    then fails with the loader's error)."""
    from patchpar.models.loading import weights_digest

    try:
        return weights_digest(model_folder(config.model.name))
    except (OSError, ValueError):
        return None


def _baseline_id(config: RunConfig) -> dict:
    """Same model weights, sampler and prompts (and code) -> same single-device outputs. A
    quantized run's baseline is the unquantized model's (`model.quant` is not part of it):
    its quality is then the quantization's cost and the strategy's together."""
    d = to_dict(config)
    d["model"].pop("quant", None)
    return {
        **{k: d[k] for k in ("model", "sampler", "prompts")},
        "git_commit": git_commit(),
        "weights_sha256": weights_sha256(config),
    }


def baseline_key(config: RunConfig) -> str:
    return hashlib.sha256(json.dumps(_baseline_id(config), sort_keys=True).encode()).hexdigest()[
        :16
    ]


def baseline_folder(config: RunConfig) -> Path:
    return Path(config.results) / ".baselines" / baseline_key(config)


def load_or_make_baseline(pipe, config: RunConfig, hw, log: Log, made=None) -> np.ndarray:
    """The single-device images for this model, sampler and prompts: from the cache, else made
    now by `pipe` (unquantized: `_baseline_id`), or taken from `made` (the run's own
    single-device output), and cached atomically."""
    folder = baseline_folder(config)
    if (folder / "images.npy").is_file():
        return np.load(folder / "images.npy")
    if made is None:
        log("  single-device baseline: generating (cached for later runs)")
        made = generate_all(pipe, config, None, hw)
    images, latents = made
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    np.save(tmp / "images.npy", images)
    np.save(tmp / "latents.npy", latents)
    (tmp / "key.json").write_text(json.dumps(_baseline_id(config), indent=2))
    try:
        os.replace(tmp, folder)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return np.load(folder / "images.npy")
