"""The family registry: every family's presets give a `Denoiser`, folders are recognised by
their class names, unknown and unsupported ones are named with the supported families, and no
library code outside a family's own package branches on a family's name."""

import json
import re
from pathlib import Path

import pytest

from patchpar.models import family as registry
from patchpar.models.family import Denoiser
from patchpar.models.loading import CheckpointError
from patchpar.models.presets import PRESETS, abstract_denoiser, model_family


def test_every_preset_belongs_to_one_family_and_gives_a_denoiser():
    names = [n for f in registry.families().values() for n in f.presets]
    assert sorted(names) == sorted(PRESETS) and len(names) == len(set(names))
    for name in PRESETS:
        fam = model_family(name)
        fn = abstract_denoiser(name)
        assert isinstance(fn, Denoiser) and fn.family == fam.name, name
    assert sorted(registry.families()) == ["flux", "pixart", "sd3", "unet", "wan"]


@pytest.mark.parametrize(
    "cls, family",
    [
        ("StableDiffusionXLPipeline", "unet"),
        ("PixArtSigmaPipeline", "pixart"),
        ("FluxPipeline", "flux"),
        ("UNet2DConditionModel", "unet"),
        ("FluxTransformer2DModel", "flux"),
        ("StableDiffusion3Pipeline", "sd3"),
        ("SD3Transformer2DModel", "sd3"),
        ("WanPipeline", "wan"),
        ("WanTransformer3DModel", "wan"),
    ],
)
def test_folders_are_recognised_by_class(cls, family, tmp_path):
    name = "model_index.json" if cls.endswith("Pipeline") else "config.json"
    (tmp_path / name).write_text(json.dumps({"_class_name": cls}))
    assert registry.of_folder(tmp_path).name == family


@pytest.mark.parametrize(
    "cls, what",
    [
        ("QwenImagePipeline", "Qwen-Image"),
        ("WanImageToVideoPipeline", "Wan image-to-video"),
        ("HunyuanVideoPipeline", "HunyuanVideo"),
        ("HunyuanDiTPipeline", "HunyuanDiT"),
    ],
)
def test_unsupported_families_are_named_with_the_supported(cls, what, tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    with pytest.raises(CheckpointError, match=f"unsupported: {cls} is {what}.*unet: .*flux: "):
        registry.of_folder(tmp_path)
    with pytest.raises(ValueError, match=r"unknown model family 'hunyuan'; known: \['unet'"):
        registry.named("hunyuan")


def test_no_family_name_branches_outside_a_family_package():
    """`family == "..."` and the like belong to a family's own package: elsewhere the library
    asks the family."""
    root = Path(registry.__file__).resolve().parent.parent
    own = {root / "models" / name for name in registry.PACKAGES}
    names = "|".join(registry.families())
    pattern = re.compile(rf"""[=!]=\s*["']({names})["']|["']({names})["']\s*[=!]=""")
    found = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        if not any(path.is_relative_to(p) for p in own)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
