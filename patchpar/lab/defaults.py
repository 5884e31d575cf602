"""The experiment defaults tuned per model (not the library's: a pipeline takes what it is
given, or its family's published default): the guidance scale and sampler each trained preset
was tuned at, and the classifier and CLIP model that score a preset's images."""

from __future__ import annotations

from pathlib import Path

# Classifier-free guidance each trained preset was tuned at (fmnist: on held-out seeds 100-104,
# fmnist-dit: 100-149 with its TUNED_SAMPLER; paper_repro.md "The fmnist model" and "The
# fmnist-dit model"); other models take their family's pipelines' default (SD 7.5, PixArt 4.5).
# fmnist-flux is guidance-free (no guidance input): 1 keeps its pipeline from warning that a
# scale goes unused; it guides by true CFG (TUNED_TRUE_CFG). fmnist-video: 2, 3, 4, 5, 6, 7 and 9 on
# held-out seeds 100-103 with 20 UniPC steps (results/fmnist_video/guidance): Wan's default
# read the most, 4-7 within the standard error.
TUNED_GUIDANCE = {"fmnist": 2.0, "fmnist-dit": 2.0, "fmnist-flux": 1.0, "fmnist-video": 5.0}

# True classifier-free guidance (FLUX.1 pipelines' true_cfg_scale) of a guidance-free trained
# preset, tuned with its step count on held-out seeds 100-149 (results/fmnist_flux_sampler;
# paper_repro.md "The fmnist-flux model").
TUNED_TRUE_CFG: dict[str, float] = {"fmnist-flux": 2.0}  # with 8 flow-Euler steps

# The solver each trained preset was tuned with, where it is not 20-step DDIM (fmnist-dit: on
# held-out seeds 100-149, results/fmnist_dit_sampler; PixArt's pipelines' DPM-Solver++ too).
TUNED_SAMPLER = {"fmnist-dit": "dpmpp_2m"}

# The CLIP model (`presets.CLIP_MODELS`) `clip_score` uses by default for each model
# (experiments/train_clip_fmnist.py).
DEFAULT_CLIP = {
    "fmnist": "fmnist-clip",
    "fmnist-random": "fmnist-clip",
    "fmnist-dit": "fmnist-clip",
    "fmnist-flux": "fmnist-clip",
}
# fmnist-random, fmnist-dit and fmnist-flux make images in fmnist's frame: fmnist's classifier
# scores them; fmnist-video-random's clips are fmnist-video's (its classifier/ reads the items
# `measure.motion.item_crops` cuts out of the frames).
CLASSIFIER_OF = {
    "fmnist-random": "fmnist",
    "fmnist-dit": "fmnist",
    "fmnist-flux": "fmnist",
    "fmnist-video-random": "fmnist-video",
}


def default_sampler(model: str | Path) -> str:
    """The tuned sampler of a trained preset, else the model family's (DDIM; FLUX: the
    flow-matching Euler)."""
    from patchpar.models.presets import model_family

    name = str(model)
    if name in TUNED_SAMPLER:
        return TUNED_SAMPLER[name]
    return model_family(name).default_sampler


def default_guidance(model: str | Path) -> float:
    """The tuned scale of a trained preset, else the model family's pipelines' default."""
    from patchpar.models.presets import model_family

    name = str(model)
    if name in TUNED_GUIDANCE:
        return TUNED_GUIDANCE[name]
    return model_family(name).default_guidance


def default_true_cfg(model: str | Path) -> float:
    """The tuned true-CFG scale of a trained preset, else 1 (off)."""
    return TUNED_TRUE_CFG.get(str(model), 1.0)
