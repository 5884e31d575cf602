"""Named presets: the diffusers configs of SD 1.5, SD 2.1, SDXL, PixArt-α and PixArt-Σ (full
shapes, for abstract lowering without weights) and `tiny` / `tiny-xl` / `tiny-dit` (SD-like,
SDXL-like and PixArt-like test and quick-start sizes, written on first use as a real
diffusers-format folder with deterministic random weights)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp

_SD_SCHED = {
    "_class_name": "DDIMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
}
_UNET_SD = {
    "_class_name": "UNet2DConditionModel",
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280, 1280],
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "downsample_padding": 1,
    "act_fn": "silu",
}
_VAE_SD = {
    "_class_name": "AutoencoderKL",
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "act_fn": "silu",
    "scaling_factor": 0.18215,
}
_CLIP_L = {
    "architectures": ["CLIPTextModel"],
    "model_type": "clip_text_model",
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 49407,
}

PRESETS: dict[str, dict[str, dict]] = {
    "sd15": {
        "unet": {
            **_UNET_SD,
            "sample_size": 64,
            "attention_head_dim": 8,
            "cross_attention_dim": 768,
        },
        "vae": {**_VAE_SD, "sample_size": 512},
        "text_encoder": _CLIP_L,
        "scheduler": _SD_SCHED,
    },
    "sd21": {
        "unet": {
            **_UNET_SD,
            "sample_size": 96,
            "attention_head_dim": [5, 10, 20, 20],
            "cross_attention_dim": 1024,
            "use_linear_projection": True,
        },
        "vae": {**_VAE_SD, "sample_size": 768},
        "text_encoder": {
            **_CLIP_L,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 23,
            "num_attention_heads": 16,
            "hidden_act": "gelu",
        },
        "scheduler": {**_SD_SCHED, "prediction_type": "v_prediction"},
    },
    "sdxl": {
        "unet": {
            **_UNET_SD,
            "sample_size": 128,
            "block_out_channels": [320, 640, 1280],
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            "attention_head_dim": [5, 10, 20],
            "transformer_layers_per_block": [1, 2, 10],
            "cross_attention_dim": 2048,
            "use_linear_projection": True,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,
        },
        "vae": {**_VAE_SD, "sample_size": 1024, "scaling_factor": 0.13025},
        "text_encoder": _CLIP_L,
        "text_encoder_2": {
            **_CLIP_L,
            "architectures": ["CLIPTextModelWithProjection"],
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_attention_heads": 20,
            "hidden_act": "gelu",
            "projection_dim": 1280,
        },
        "scheduler": {**_SD_SCHED, "timestep_spacing": "leading"},
    },
}

# PixArt-α XL-2 1024-MS and PixArt-Σ XL-2 1024-MS (diffusers folders): the same 28-block DiT
# (D 1152, 16 heads, patch 2, learned sigma), T5 v1.1 XXL (4096 wide, 24 layers, gated GELU)
# reading 120 / 300 tokens, DPM-Solver++ on DDPM's linear betas; α has micro-conditions and the
# SD VAE, Σ neither micro-conditions nor that VAE (it uses SDXL's).
_PIXART = {
    "_class_name": "PixArtTransformer2DModel",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 72,
    "caption_channels": 4096,
    "cross_attention_dim": 1152,
    "in_channels": 4,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "norm_type": "ada_norm_single",
    "num_attention_heads": 16,
    "num_embeds_ada_norm": 1000,
    "num_layers": 28,
    "out_channels": 8,
    "patch_size": 2,
    "sample_size": 128,
}
_T5_XXL = {
    "architectures": ["T5EncoderModel"],
    "model_type": "t5",
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-6,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "vocab_size": 32128,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
_PIXART_SCHED = {
    "_class_name": "DPMSolverMultistepScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "prediction_type": "epsilon",
    "solver_order": 2,
    "algorithm_type": "dpmsolver++",
    "timestep_spacing": "linspace",
}
PRESETS["pixart-alpha"] = {
    "pipeline": {"_class_name": "PixArtAlphaPipeline"},
    "transformer": {**_PIXART, "use_additional_conditions": True},
    "vae": {**_VAE_SD, "sample_size": 1024},
    "text_encoder": _T5_XXL,
    "scheduler": _PIXART_SCHED,
}
PRESETS["pixart-sigma"] = {
    "pipeline": {"_class_name": "PixArtSigmaPipeline"},
    "transformer": {**_PIXART, "interpolation_scale": 2, "use_additional_conditions": False},
    "vae": {**_VAE_SD, "sample_size": 1024, "scaling_factor": 0.13025},
    "text_encoder": _T5_XXL,
    "scheduler": _PIXART_SCHED,
}

_TINY_CLIP = {
    **_CLIP_L,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
_TINY_VAE = {
    **_VAE_SD,
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "sample_size": 256,
}
PRESETS["tiny"] = {
    "unet": {
        **_UNET_SD,
        "sample_size": 32,
        "block_out_channels": [32, 64, 64],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "attention_head_dim": 4,
        "cross_attention_dim": 32,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    },
    "vae": _TINY_VAE,
    "text_encoder": _TINY_CLIP,
    "scheduler": _SD_SCHED,
}
PRESETS["tiny-xl"] = {
    "unet": {
        **PRESETS["sdxl"]["unet"],
        "sample_size": 32,
        "block_out_channels": [32, 64, 64],
        "norm_num_groups": 8,
        "attention_head_dim": [2, 4, 4],
        "transformer_layers_per_block": [1, 2, 2],
        "cross_attention_dim": 64,
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": 32 + 6 * 8,
    },
    "vae": {**_TINY_VAE, "scaling_factor": 0.13025},
    "text_encoder": _TINY_CLIP,
    "text_encoder_2": {
        **_TINY_CLIP,
        "architectures": ["CLIPTextModelWithProjection"],
        "projection_dim": 32,
    },
    "scheduler": PRESETS["sdxl"]["scheduler"],
}
# The `fmnist` architecture (pixel space, no VAE: 32x32 grey images in [-1, 1]), trained by
# experiments/train_fmnist.py; `fmnist-random` is it with random weights (the FID reference).
PRESETS["fmnist-random"] = {
    "unet": {
        **PRESETS["tiny"]["unet"],
        "sample_size": 32,
        "in_channels": 1,
        "out_channels": 1,
        # 16/32/64 channels at 32x32/16x16/8x8, attention (self + cross) at 8x8 and in the
        # mid block: 3x cheaper per training step on the CPU than 32/64/64 with attention at
        # 16x16 too (538 vs 1650 ms at batch 32), so the 90-minute budget sees ~4 epochs.
        "block_out_channels": [16, 32, 64],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "attention_head_dim": 2,  # diffusers' legacy name: 2 heads (of 64 channels at 8x8)
        "cross_attention_dim": 32,
        "down_block_types": ["DownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D", "UpBlock2D"],
    },
    "text_encoder": _TINY_CLIP,
    "scheduler": {  # DDPM's linear betas; DDIM clips x0 to the pixel range
        "_class_name": "DDIMScheduler",
        "num_train_timesteps": 1000,
        "beta_start": 0.0001,
        "beta_end": 0.02,
        "beta_schedule": "linear",
        "clip_sample": True,
        "set_alpha_to_one": False,
        "steps_offset": 1,
        "prediction_type": "epsilon",
    },
}
PRESETS["tiny-dit"] = {  # PixArt-α-like: micro-conditions, learned sigma, 120 T5 tokens
    "pipeline": {"_class_name": "PixArtAlphaPipeline"},
    "transformer": {
        **_PIXART,
        "attention_head_dim": 12,
        "num_attention_heads": 2,
        "cross_attention_dim": 24,
        "caption_channels": 32,
        "num_layers": 2,
        "sample_size": 32,
        "use_additional_conditions": True,
    },
    "vae": _TINY_VAE,
    "text_encoder": {
        **_T5_XXL,
        "d_model": 32,
        "d_ff": 64,
        "d_kv": 8,
        "num_heads": 4,
        "num_layers": 2,
        "vocab_size": 256,
    },
    "scheduler": _PIXART_SCHED,
}
# The text a random-weight preset's T5 tokenizer is trained on (sentencepiece, offline).
_TOKENIZER_TEXT = [
    "a photo of a cat sitting on a wooden table",
    "an astronaut riding a horse on the moon, highly detailed",
    "a red trouser, a blue pullover and a white sneaker",
    "a bag, an ankle boot, a sandal, a shirt, a coat and a dress",
    "a small house by a lake at sunset, oil painting",
    "two dogs playing in the snow, watercolor",
    "a city street at night in the rain with neon lights",
    "a bowl of fruit: apples, oranges and bananas",
]
WEIGHTED = ("tiny", "tiny-xl", "tiny-dit", "fmnist-random")  # random weights, on first use
# Presets with trained weights committed in the repository (experiments/train_fmnist.py).
_WEIGHTS = Path(__file__).resolve().parent.parent / "weights"
# fmnist-dit: a PixArt-architecture DiT trained by experiments/train_fmnist_dit.py
SHIPPED = {"fmnist": _WEIGHTS / "fmnist", "fmnist-dit": _WEIGHTS / "fmnist-dit"}
# CLIP models committed in the repository (open_clip local-dir folders), by name, and the one
# `clip_score` uses by default for each model (experiments/train_clip_fmnist.py).
CLIP_MODELS = {"fmnist-clip": _WEIGHTS / "fmnist-clip"}
DEFAULT_CLIP = {
    "fmnist": "fmnist-clip",
    "fmnist-random": "fmnist-clip",
    "fmnist-dit": "fmnist-clip",
}
# fmnist-random and fmnist-dit make images in fmnist's frame: fmnist's classifier scores them.
CLASSIFIER_OF = {"fmnist-random": "fmnist", "fmnist-dit": "fmnist"}
TINY_SEED = 0
# Classifier-free guidance each trained preset was tuned at (fmnist: on held-out seeds 100-104,
# fmnist-dit: 100-149 with its TUNED_SAMPLER; paper_repro.md "The fmnist model" and "The fmnist-dit model"); other models take the SD
# pipelines' 7.5 (PixArt: 4.5).
TUNED_GUIDANCE = {"fmnist": 2.0, "fmnist-dit": 2.0}
DEFAULT_GUIDANCE = 7.5
DIT_GUIDANCE = 4.5  # PixArt-α/Σ's pipelines' default


# The solver each trained preset was tuned with, where it is not 20-step DDIM (fmnist-dit: on
# held-out seeds 100-149, results/fmnist_dit_sampler; PixArt's pipelines' DPM-Solver++ too).
TUNED_SAMPLER = {"fmnist-dit": "dpmpp_2m"}
DEFAULT_SAMPLER = "ddim"


def default_sampler(model: str) -> str:
    return TUNED_SAMPLER.get(str(model), DEFAULT_SAMPLER)


def default_guidance(model: str) -> float:
    name = str(model)
    if name in TUNED_GUIDANCE:
        return TUNED_GUIDANCE[name]
    return DIT_GUIDANCE if family(name) == "pixart" else DEFAULT_GUIDANCE


def family(model: str | Path) -> str:
    """`unet` or `pixart`: the denoiser of a preset or a diffusers folder (a folder whose
    denoiser is unreadable counts as a UNet; its loader says why)."""
    name = str(model)
    if name in PRESETS:
        return "pixart" if "transformer" in PRESETS[name] else "unet"
    if name in SHIPPED:
        model = SHIPPED[name]
    folder = Path(model)
    return "pixart" if (folder / "transformer" / "config.json").is_file() else "unet"


# The T5 tokens each PixArt pipeline reads (diffusers' `max_sequence_length` defaults).
MAX_TEXT_TOKENS = {"PixArtAlphaPipeline": 120, "PixArtSigmaPipeline": 300}


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


def abstract_denoiser(model: str | Path, dtype=jnp.bfloat16, attention=None):
    """A denoiser (no weights: a UNet or a PixArt transformer) from a preset name or a diffusers
    folder's unet/ or transformer/ config.json: enough to lower its programs with abstract
    parameters."""
    from patchpar.models import api
    from patchpar.models.attention import AttentionSpec
    from patchpar.models.loading import read_config
    from patchpar.models.pixart import PixArtConfig, PixArtTransformer2DModel
    from patchpar.models.unet import UNet2DConditionModel, UNetConfig

    name = str(model)
    check_model(name)
    if name in SHIPPED:
        model = preset_folder(name)
    kind = family(model)
    sub = "transformer" if kind == "pixart" else "unet"
    if name in PRESETS:
        cfg, where = PRESETS[name][sub], f"preset {name}"
    else:
        folder = Path(model)
        folder = folder / sub if (folder / sub / "config.json").is_file() else folder
        cfg, where = read_config(folder), str(folder / "config.json")
        if cfg.get("_class_name", "UNet2DConditionModel") != "UNet2DConditionModel":
            kind = "pixart"  # a transformer component folder itself (unsupported ones named)
    attn = attention or AttentionSpec()
    if kind == "pixart":
        module = PixArtTransformer2DModel(PixArtConfig.from_diffusers(cfg, where), dtype, attn=attn)
        return api.PixArtFn(module)
    return api.UNetFn(UNet2DConditionModel(UNetConfig.from_diffusers(cfg, where), dtype, attn=attn))


FULL_SIZE = ("sd15", "sd21", "sdxl", "pixart-alpha", "pixart-sigma")


def default_dtype(model: str | Path) -> str:
    """The compute dtype `auto` means: bfloat16 for the full-size presets and for folders whose
    UNet starts at >= 320 channels (SD 1.x/2.x/XL sizes) or whose DiT is >= 1024 wide,
    float32 for the small models (parity tests, tiny, fmnist)."""
    from patchpar.models.loading import read_config

    name = str(model)
    if name in FULL_SIZE:
        return "bfloat16"
    if name in PRESETS or name in SHIPPED:
        return "float32"
    folder = Path(model)
    try:
        if family(folder) == "pixart":
            cfg = read_config(folder / "transformer")
            big = cfg["num_attention_heads"] * cfg["attention_head_dim"] >= 1024
        else:
            folder = folder / "unet" if (folder / "unet" / "config.json").is_file() else folder
            big = read_config(folder)["block_out_channels"][0] >= 320
    except Exception:  # not readable here: the loader will say why
        return "float32"
    return "bfloat16" if big else "float32"


def resolve_dtype(dtype: str, model: str | Path) -> str:
    return default_dtype(model) if dtype == "auto" else dtype


def latent_factor(model: str | Path) -> int:
    """Image pixels per latent pixel of a preset or diffusers folder (1: pixel space, no VAE)."""
    from patchpar.models.vae import VAEConfig

    vae = component_config(model, "vae")
    return 1 if vae is None else VAEConfig.from_diffusers(vae).downsample_factor


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
    """Where generated model folders live: $PATCHPAR_HOME, else ~/.cache/patchpar."""
    return Path(os.environ.get("PATCHPAR_HOME", Path.home() / ".cache" / "patchpar"))


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
    """A diffusers-format pipeline folder with deterministic random weights."""
    import json

    from patchpar.models import api
    from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
    from patchpar.models.loading import write_component
    from patchpar.models.tokenizer import write_clip_tokenizer
    from patchpar.models.vae import AutoencoderKL, VAEConfig

    folder = Path(folder)
    if "transformer" in preset:
        return _write_random_dit(folder, preset, seed)
    unet = _random_denoiser(preset, "unet")
    write_component(folder / "unet", preset["unet"], unet.init(seed))
    index = {
        "_class_name": "StableDiffusionPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "scheduler": ["diffusers", "DDIMScheduler"],
    }
    if "vae" in preset:  # none: a pixel-space model
        vae = api.VAEFn(AutoencoderKL(VAEConfig.from_diffusers(preset["vae"]), jnp.float32))
        write_component(folder / "vae", preset["vae"], vae.init(seed + 1))
        index["vae"] = ["diffusers", "AutoencoderKL"]
    for k, sub in enumerate(("text_encoder", "text_encoder_2")):
        if sub not in preset:
            continue
        te = api.TextEncoderFn(CLIPTextModel(CLIPTextConfig.from_transformers(preset[sub])))
        write_component(folder / sub, preset[sub], te.init(seed + 2 + k))
        write_clip_tokenizer(folder / sub.replace("text_encoder", "tokenizer"))
        index[sub] = ["transformers", preset[sub]["architectures"][0]]
        index[sub.replace("text_encoder", "tokenizer")] = ["transformers", "CLIPTokenizer"]
    if "text_encoder_2" in preset:
        index["_class_name"] = "StableDiffusionXLPipeline"
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(preset["scheduler"], indent=2)
    )
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def _random_denoiser(preset: dict, sub: str):
    from patchpar.models import api
    from patchpar.models.pixart import PixArtConfig, PixArtTransformer2DModel
    from patchpar.models.unet import UNet2DConditionModel, UNetConfig

    if sub == "transformer":
        return api.PixArtFn(PixArtTransformer2DModel(PixArtConfig.from_diffusers(preset[sub])))
    return api.UNetFn(UNet2DConditionModel(UNetConfig.from_diffusers(preset[sub]), jnp.float32))


def _write_random_dit(folder: Path, preset: dict, seed: int) -> None:
    """A PixArt pipeline folder: transformer/, vae/, a T5 text_encoder/ and its sentencepiece
    tokenizer/ (trained here on a few captions), scheduler/, model_index.json."""
    import json

    from patchpar.models import api
    from patchpar.models.loading import write_component
    from patchpar.models.t5 import T5Config, T5EncoderModel
    from patchpar.models.tokenizer import write_t5_tokenizer
    from patchpar.models.vae import AutoencoderKL, VAEConfig

    write_component(
        folder / "transformer",
        preset["transformer"],
        _random_denoiser(preset, "transformer").init(seed),
    )
    vae = api.VAEFn(AutoencoderKL(VAEConfig.from_diffusers(preset["vae"]), jnp.float32))
    write_component(folder / "vae", preset["vae"], vae.init(seed + 1))
    t5 = api.T5EncoderFn(T5EncoderModel(T5Config.from_transformers(preset["text_encoder"])))
    write_component(folder / "text_encoder", preset["text_encoder"], t5.init(seed + 2))
    vocab = preset["text_encoder"]["vocab_size"]
    write_t5_tokenizer(folder / "tokenizer", _TOKENIZER_TEXT, vocab_size=vocab)
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(preset["scheduler"], indent=2)
    )
    index = {
        "_class_name": preset["pipeline"]["_class_name"],
        "transformer": ["diffusers", "PixArtTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "scheduler": ["diffusers", preset["scheduler"]["_class_name"]],
    }
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
