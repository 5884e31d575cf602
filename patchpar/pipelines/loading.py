"""A pipeline from a local diffusers folder or a preset (`load_pipeline`): the family found, its
denoiser (or its quantized checkpoint), text encoders, VAE and scheduler read."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp

from patchpar.models.attention import AUTO, AttentionSpec
from patchpar.models.loading import read_config
from patchpar.models.presets import PRESETS, SHIPPED, check_model, model_family, preset_folder
from patchpar.pipelines.text2img import Pipeline
from patchpar.sampling.schedulers import SchedulerConfig


def load_pipeline(
    path_or_preset: str | Path,
    dtype=jnp.float32,
    attention: AttentionSpec = AUTO,
    quant: str = "none",
) -> Pipeline:
    """A pipeline from a local diffusers folder of any supported family (SD, SDXL, PixArt-α/Σ),
    or a preset name with weights (`fmnist`, `tiny`, `tiny-xl`, `tiny-dit`). A folder without
    `vae/` is a pixel-space model. `attention` picks the attention kernel of the denoiser and
    the VAE (default `auto`: patchpar/models/attention.py). A folder of a family patchpar does
    not run is an error naming it, before any component is read. `quant` quantizes the
    denoiser once its weights are loaded in `dtype` (`Pipeline.quantized`), or reads the
    folder's quantized checkpoint for that mode where `save_quantized` wrote one (its config
    checked against the folder's, and its float weights' digest against the floats beside it:
    none is loaded, and they are read to hash them only where their files changed since the
    checkpoint was saved)."""
    from patchpar.models.attention import resolve
    from patchpar.quant import check_mode, checkpoint_paths, load_quantized

    name = str(path_or_preset)
    check_mode(quant)  # an unknown mode before anything is read
    check_model(name)  # a preset or a folder, else the presets and the nearest names
    folder = preset_folder(name) if name in PRESETS or name in SHIPPED else Path(name)
    fam = model_family(folder)
    index = _model_index(folder)
    sub = folder / fam.denoiser_folder
    fam.check_index(index)  # before any weight is read
    second = fam.second_expert(index)  # (subfolder, boundary ratio) of a second expert
    read, stamp = None, None  # the quantized checkpoint read; the float files read
    saved = quant != "none" and checkpoint_paths(sub, quant)[1].is_file()
    if saved and second is None:  # quantized, no floats read (two experts: both quantized below)
        from patchpar.models.presets import abstract_denoiser

        fn = abstract_denoiser(folder, dtype, resolve(attention, dtype))
        denoiser = load_quantized(fn, sub, quant, read_config(sub))
        read = checkpoint_paths(sub, quant)[0]
    else:
        if jax.default_backend() != "cpu":  # weights that cannot fit: said before reading them
            from patchpar.measure.cost import check_weights_fit
            from patchpar.models.presets import abstract_denoiser

            fn = abstract_denoiser(folder, dtype)
            weights = fn.abstract_params()  # both experts' where there are two
            what = f"{name} in {jnp.dtype(dtype).name}" + (" (two experts)" if second else "")
            check_weights_fit(weights if second is None else (weights, weights), what)
        stamp = _float_stamp(sub)
        denoiser = fam.load_denoiser(sub, dtype, resolve(attention, dtype))
    text = fam.load_text(folder, index, dtype)
    vae = (
        fam.load_vae(folder / "vae", dtype, attention)
        if (folder / "vae").is_dir()
        else (None, None)
    )
    sched = SchedulerConfig.from_diffusers(
        read_config(folder / "scheduler", "scheduler_config.json")
    )
    sched = replace(sched, flow_sigmas=fam.flow_sigmas)
    if fam.video:
        from patchpar.pipelines.text2video import VideoPipeline as cls
    else:
        cls = Pipeline
    pipe = cls(*denoiser, *vae, text, sched, name, fam.default_sampler, read, stamp)
    if second is not None:
        pipe = replace(pipe, unet_params_2=_second_expert(fam, folder, second[0], dtype, attention),
                       boundary_ratio=second[1])  # fmt: skip
    return pipe if pipe.quant == quant else pipe.quantized(quant)


def _second_expert(fam, folder: Path, sub: str, dtype, attention: AttentionSpec) -> dict:
    """The parameters of a second expert's folder, whose config must be the denoiser's own
    (one compiled denoiser runs both: `sampling.experts`); CheckpointError naming the keys
    that differ."""
    from patchpar.models.attention import resolve
    from patchpar.models.loading import CheckpointError

    first, other = (read_config(folder / s) for s in (fam.denoiser_folder, sub))
    keys = sorted(
        k for k in {*first, *other} if not k.startswith("_") and first.get(k) != other.get(k)
    )
    if keys:
        diff = ", ".join(f"{k}: {first.get(k)!r} vs {other.get(k)!r}" for k in keys)
        raise CheckpointError(
            f"{str(folder / sub)!r}: a second expert must have the {fam.denoiser_folder}'s "
            f"architecture; its config differs in {diff}"
        )
    return fam.load_denoiser(folder / sub, dtype, resolve(attention, dtype))[1]


def _float_stamp(sub: Path) -> tuple | None:
    """The float files' stamp as the loader is about to read them (None: it holds none; the
    loader then says so)."""
    from patchpar.quant import float_stamp

    try:
        return float_stamp(sub)
    except ValueError:
        return None


def _model_index(folder: Path) -> dict:
    """model_index.json ({} if absent; its class was checked by `model_family`)."""
    path = folder / "model_index.json"
    return json.loads(path.read_text()) if path.is_file() else {}
