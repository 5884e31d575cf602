"""Named models: every family's presets (the published configs at full shape, for abstract
lowering without weights, and the tiny test and quick-start sizes, written on first use as a
real diffusers-format folder with deterministic random weights; `patchpar.models.<family>.
presets`) and the models whose trained weights ship in the repository (`SHIPPED`). The
answers that depend on the family (which one a model is, its denoiser, its default dtype)
come from the family registry (`patchpar.models.family`). Tuned experiment defaults per
preset (guidance, sampler, classifier, CLIP) are the lab's (`patchpar.lab.defaults`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp

from patchpar.models.family import Family, families, of_folder, of_preset

PRESETS: dict[str, dict[str, dict]] = {
    name: preset for fam in families().values() for name, preset in fam.presets.items()
}
WEIGHTED = tuple(name for fam in families().values() for name in fam.weighted)
FULL_SIZE = tuple(name for fam in families().values() for name in fam.full_size)

# Presets with trained weights committed in the repository (experiments/train_fmnist.py,
# experiments/train_fmnist_dit.py: a PixArt-architecture DiT, experiments/train_fmnist_flux.py:
# a FLUX.1-architecture MMDiT on a small VAE's latent, experiments/train_fmnist_video.py: a
# pixel-space Wan making 8-frame clips).
_WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
SHIPPED = {
    name: _WEIGHTS / name for name in ("fmnist", "fmnist-dit", "fmnist-flux", "fmnist-video")
}
# CLIP models committed in the repository (open_clip local-dir folders), by name
# (experiments/train_clip_fmnist.py).
CLIP_MODELS = {"fmnist-clip": _WEIGHTS / "fmnist-clip"}
TINY_SEED = 0


def model_family(model: str | Path) -> Family:
    """The family of a preset, a shipped model or a diffusers folder (CheckpointError for a
    folder of no family patchpar runs, naming what it is and the supported families)."""
    name = str(model)
    check_model(name)
    fam = of_preset(name)
    if fam is not None:
        return fam
    return of_folder(SHIPPED.get(name, name))


def family(model: str | Path) -> str:
    """The name of a model's family (`unet`, `pixart`, ...): `model_family(model).name`."""
    return model_family(model).name


def preset_names() -> list[str]:
    return sorted([*PRESETS, *SHIPPED])


def check_model(model: str | Path) -> None:
    """ValueError (a CheckpointError) when `model` is neither a preset nor a folder, naming
    the presets and the nearest names."""
    import difflib

    from patchpar.models.loading import CheckpointError

    name = str(model)
    if name in PRESETS or name in SHIPPED or Path(name).is_dir():
        return
    near = difflib.get_close_matches(name, preset_names(), n=3, cutoff=0.6)
    raise CheckpointError(
        f"model {name!r} is neither a preset ({preset_names()}) nor an existing diffusers "
        f"folder" + (f"; did you mean {', '.join(near)}?" if near else "")
    )


def get_preset(name: str) -> dict[str, dict]:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {preset_names()}") from None


def abstract_denoiser(model: str | Path, dtype=jnp.bfloat16, attention=None, overrides=None):
    """A denoiser (no weights) from a preset name or a diffusers folder's denoiser config.json:
    enough to lower its programs with abstract parameters. `overrides`: config.json keys
    replaced (a depth-reduced FLUX.1: `{"num_layers": 4, "num_single_layers": 8}`); a key the
    config lacks is a ValueError naming the keys it has."""
    from patchpar.models.attention import AttentionSpec
    from patchpar.models.loading import read_config

    name = str(model)
    fam = model_family(name)
    sub = fam.denoiser_folder
    if name in PRESETS:
        cfg, where = PRESETS[name][sub], f"preset {name}"
    else:
        folder = preset_folder(name) if name in SHIPPED else Path(model)
        folder = folder / sub if (folder / sub / "config.json").is_file() else folder
        cfg, where = read_config(folder), str(folder / "config.json")
    if overrides:
        unknown = sorted(set(overrides) - set(cfg))
        if unknown:
            raise ValueError(
                f"{name}: config override(s) {unknown} are not keys of {where}; it has "
                f"{sorted(k for k in cfg if not k.startswith('_'))}"
            )
        cfg, where = {**cfg, **overrides}, f"{where} with {overrides}"
    return fam.denoiser(cfg, where, dtype, attention or AttentionSpec())


def default_dtype(model: str | Path) -> str:
    """The compute dtype `auto` means: bfloat16 for the full-size presets and for folders of a
    full-size denoiser (the family says: a UNet of >= 320 channels, a DiT >= 1024 wide),
    float32 for the small models (parity tests, tiny, fmnist)."""
    name = str(model)
    if name in FULL_SIZE:
        return "bfloat16"
    if name in PRESETS or name in SHIPPED:
        return "float32"
    try:
        from patchpar.models.loading import read_config

        fam = model_family(name)
        folder = Path(model)
        sub = folder / fam.denoiser_folder
        big = fam.is_large(read_config(sub if (sub / "config.json").is_file() else folder))
    except Exception:  # not readable here: the loader will say why
        return "float32"
    return "bfloat16" if big else "float32"


def resolve_dtype(dtype: str, model: str | Path) -> str:
    return default_dtype(model) if dtype == "auto" else dtype


def latent_factor(model: str | Path) -> int:
    """Image pixels per latent pixel of a preset or diffusers folder (1: pixel space, no VAE)."""
    vae = component_config(model, "vae")
    return 1 if vae is None else model_family(model).vae_factor(vae)


def temporal_factor(model: str | Path) -> int:
    """Video frames per latent frame after the first of a preset or folder (1: an image VAE)."""
    vae = component_config(model, "vae")
    return 1 if vae is None else model_family(model).vae_temporal(vae)


def square_latent(model: str | Path, resolution: int, name: str = "resolution") -> int:
    """The latent side of a square `resolution`-pixel image of `model` (or of the side `name`);
    a ValueError where the VAE factor does not divide it."""
    f = latent_factor(model)
    if not isinstance(resolution, int) or resolution <= 0 or resolution % f:
        raise ValueError(
            f"{name}={resolution}: must be a positive multiple of {f} (the VAE factor)"
        )
    return resolution // f


def component_config(model: str | Path, sub: str) -> dict | None:
    """The config of component `sub` (`vae`, `text_encoder`, `text_encoder_2`, `unet`,
    `transformer`; `pipeline`: model_index.json) of a preset or a diffusers folder; None where
    it has none (a pixel-space model has no `vae`)."""
    from patchpar.models.loading import read_config

    name = str(model)
    check_model(name)
    if name in PRESETS:
        return PRESETS[name].get(sub)
    folder = preset_folder(name) if name in SHIPPED else Path(model)
    if sub == "pipeline":
        index = folder / "model_index.json"
        return json.loads(index.read_text()) if index.is_file() else None
    return read_config(folder / sub) if (folder / sub).is_dir() else None


def home() -> Path:
    """Where generated model folders, the compile cache and the workload cache live:
    $PATCHPAR_HOME, else ~/.cache/patchpar; ValueError when it names something that is not a
    folder."""
    set_ = os.environ.get("PATCHPAR_HOME")
    path = Path(set_ or Path.home() / ".cache" / "patchpar").expanduser()
    if path.exists() and not path.is_dir():
        what = f"PATCHPAR_HOME={set_!r}" if set_ else f"patchpar's home {str(path)!r}"
        raise ValueError(
            f"{what} is a file, not a folder: point PATCHPAR_HOME at a folder patchpar may "
            f"write (default ~/.cache/patchpar)"
        )
    return path


def preset_folder(name: str) -> Path:
    """The diffusers folder of a weighted preset, written (atomically) if not there yet."""
    if name in SHIPPED:
        if not (SHIPPED[name] / "model_index.json").is_file():
            raise ValueError(
                f"preset {name!r}: its weights are not at {SHIPPED[name]} (made by "
                f"experiments/train_{name.replace('-', '_')}.py and committed)"
            )
        return SHIPPED[name]
    get_preset(name)
    if name not in WEIGHTED:
        raise ValueError(
            f"preset {name!r} has full shapes but no weights here (no model hub is reachable); use it "
            f"for abstract lowering, or pass a local diffusers folder. Presets with weights: {list(WEIGHTED)}"
        )
    folder = home() / "models" / f"{name}-seed{TINY_SEED}"
    if not (folder / "model_index.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
        try:
            write_random_folder(tmp, PRESETS[name], TINY_SEED)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_random_folder(folder: Path, preset: dict[str, dict], seed: int) -> None:
    """A diffusers-format pipeline folder of `preset` (a preset's components) with
    deterministic random weights, written by the family of its denoiser (by the denoiser's
    `_class_name`; without one, the first family keeping its denoiser in that subfolder)."""
    from patchpar.models.family import of_class

    for fam in families().values():
        sub = preset.get(fam.denoiser_folder)
        if sub is not None:
            name = sub.get("_class_name")
            fam = fam if name is None else of_class(name)
            if fam is None:
                raise ValueError(f"no family runs this preset's denoiser {name!r}")
            return fam.write_random_folder(Path(folder), preset, seed)
    raise ValueError(f"a preset needs a denoiser component; got {sorted(preset)}")
