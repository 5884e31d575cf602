"""Bad input gets a clear error naming the value and what would fit."""

import json
import shutil

import numpy as np
import pytest

from patchpar.models import CheckpointError, load_text_encoder, load_unet, load_vae
from patchpar.models.presets import PRESETS, get_preset, preset_folder
from patchpar.models.tokenizer import load_tokenizer
from patchpar.models.unet import UNetConfig
from patchpar.pipelines import load_pipeline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return preset_folder("tiny")


def copy_component(tiny, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(tiny / name, dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_unet(tmp_path / "nope")


def test_missing_config(tiny, tmp_path):
    unet = copy_component(tiny, "unet", tmp_path)
    (unet / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json' is missing"):
        load_unet(unet)


def test_missing_weights_file(tiny, tmp_path):
    vae = copy_component(tiny, "vae", tmp_path)
    for f in vae.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(
        CheckpointError, match=r"no \*.safetensors weights .*found: \['config.json'\]"
    ):
        load_vae(vae)


def rewrite_weights(folder, edit):
    from safetensors.numpy import load_file, save_file

    (path,) = folder.glob("*.safetensors")
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def test_missing_key(tiny, tmp_path):
    unet = copy_component(tiny, "unet", tmp_path)
    rewrite_weights(unet, lambda s: s.pop("mid_block.attentions.0.proj_in.weight"))
    with pytest.raises(
        CheckpointError, match=r"1 key\(s\) missing .*mid_block.attentions.0.proj_in.weight"
    ):
        load_unet(unet)


def test_misshaped_key(tiny, tmp_path):
    te = copy_component(tiny, "text_encoder", tmp_path)

    def edit(s):
        key = next(k for k in s if k.endswith("final_layer_norm.weight"))
        s[key] = np.ones(31, np.float32)

    rewrite_weights(te, edit)
    with pytest.raises(
        CheckpointError,
        match=r"final_layer_norm.weight' has shape \(31,\), the model config needs \(32,\)",
    ):
        load_text_encoder(te)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("class_embed_type", "timestep", "class_embed_type='timestep' is not supported"),
        (
            "down_block_types",
            ["CrossAttnDownBlock2D", "SimpleDownBlock2D", "DownBlock2D"],
            "down_block_types=",
        ),
        ("addition_embed_type", "text_image", "addition_embed_type='text_image' not supported"),
        ("attention_head_dim", [4, 4], "attention_head_dim has 2 entries, expected 3"),
    ],
)
def test_unsupported_unet_config(key, value, message):
    with pytest.raises(ValueError, match=message):
        UNetConfig.from_diffusers({**PRESETS["tiny"]["unet"], key: value})


def test_unsupported_config_in_folder(tiny, tmp_path):
    unet = copy_component(tiny, "unet", tmp_path)
    cfg = json.loads((unet / "config.json").read_text())
    (unet / "config.json").write_text(json.dumps({**cfg, "time_embedding_type": "fourier"}))
    with pytest.raises(
        ValueError, match=r"unet/config.json: time_embedding_type='fourier' is not supported"
    ):
        load_unet(unet)


def test_unsupported_text_encoder(tiny, tmp_path):
    te = copy_component(tiny, "text_encoder", tmp_path)
    cfg = json.loads((te / "config.json").read_text())
    (te / "config.json").write_text(json.dumps({**cfg, "hidden_act": "relu"}))
    with pytest.raises(
        ValueError, match=r"hidden_act='relu' not supported \(supported: \['gelu', 'quick_gelu'\]\)"
    ):
        load_text_encoder(te)


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(CheckpointError, match="need vocab.json and merges.txt, or tokenizer.json"):
        load_tokenizer(tmp_path)


def test_unknown_preset_and_weightless_preset():
    with pytest.raises(
        ValueError,
        match=r"unknown preset 'sd3'; known: \['flux-dev', 'flux-schnell', 'fmnist', 'fmnist-dit', 'fmnist-flux', 'fmnist-random', 'fmnist-video', 'fmnist-video-random', 'pixart-alpha', 'pixart-sigma', 'sd15', 'sd21', 'sd3-medium', 'sd3\.5-large', 'sd3\.5-medium', 'sdxl', 'tiny', 'tiny-dit', 'tiny-flux', 'tiny-sd3', 'tiny-wan', 'tiny-xl', 'wan2\.1-1\.3b', 'wan2\.1-14b', 'wan2\.2-5b'\]",
    ):
        get_preset("sd3")
    with pytest.raises(ValueError, match="preset 'sdxl' has full shapes but no weights here"):
        load_pipeline("sdxl")
    with pytest.raises(CheckpointError, match="neither a preset"):
        load_pipeline("/no/such/folder")


def test_bad_image_size_names_what_fits(tiny):
    pipe = load_pipeline("tiny")
    with pytest.raises(
        ValueError,
        match=r"height=100 must be a positive multiple of 32 .* nearest that fit: \[96, 128\]",
    ):
        pipe("a cat", height=100, width=64, steps=2)
    with pytest.raises(ValueError, match=r"unknown sampler 'heun'"):
        pipe("a cat", height=64, width=64, steps=2, sampler="heun")
    with pytest.raises(ValueError, match=r"steps=0: need an integer in \[1, 1000\]"):
        pipe("a cat", height=64, width=64, steps=0)


def test_a_patchpar_home_that_is_a_file_is_named(tmp_path, monkeypatch, capsys):
    """PATCHPAR_HOME naming a file (where model folders, the compile cache and workloads go):
    one line naming it, from the library and from a command (exit 2), not NotADirectoryError."""
    from patchpar.lab.cli import main
    from patchpar.models.presets import home

    path = tmp_path / "home"
    path.write_text("")
    monkeypatch.setenv("PATCHPAR_HOME", str(path))
    with pytest.raises(ValueError, match=rf"PATCHPAR_HOME='{path}' is a file, not a folder"):
        home()
    assert main(["generate", "--model", "tiny", "--steps", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("patchpar: error: PATCHPAR_HOME=") and "is a file" in err[-1]
