"""The FLUX family's presets: the diffusers configs of FLUX.1-dev and FLUX.1-schnell (full
shapes, for abstract lowering without weights) and `tiny-flux` (a dev-like test size: the
guidance embedding, double and single blocks, RoPE; written with random weights on first
use)."""

from patchpar.models.configs import CLIP_L, SD_VAE, T5_XXL, TINY_CLIP, TINY_T5

# FLUX.1-dev / -schnell (black-forest-labs, diffusers folders): 19 double-stream and 38
# single-stream blocks of width 3072 (24 heads of 128), RoPE on (16, 56, 56) head dims; dev
# embeds the guidance scale (guidance distillation), schnell does not (timestep distillation,
# 4 steps). CLIP-L gives the pooled vector, T5 v1.1 XXL the 512 (dev) / 256 (schnell) tokens.
_FLUX = {
    "_class_name": "FluxTransformer2DModel",
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
# The 16-channel VAE: SD's shape, no quant convs, latents shifted then scaled.
_FLUX_VAE = {
    **SD_VAE,
    "latent_channels": 16,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "sample_size": 1024,
}
# Flow matching: sigmas from 1 to 1/N, shifted by mu from the image's tokens (dev) or fixed
# (schnell: shift 1).
_DEV_SCHED = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
_SCHNELL_SCHED = {**_DEV_SCHED, "shift": 1.0, "use_dynamic_shifting": False}

PRESETS: dict[str, dict[str, dict]] = {
    "flux-dev": {
        "pipeline": {"_class_name": "FluxPipeline"},
        "transformer": {**_FLUX, "sample_size": 128},
        "vae": _FLUX_VAE,
        "text_encoder": CLIP_L,
        "text_encoder_2": T5_XXL,
        "scheduler": _DEV_SCHED,
    },
    "flux-schnell": {
        "pipeline": {"_class_name": "FluxPipeline", "max_sequence_length": 256},
        "transformer": {**_FLUX, "guidance_embeds": False, "sample_size": 128},
        "vae": _FLUX_VAE,
        "text_encoder": CLIP_L,
        "text_encoder_2": T5_XXL,
        "scheduler": _SCHNELL_SCHED,
    },
}
PRESETS["tiny-flux"] = {  # dev-like: guidance embedding, 2 double + 2 single blocks
    "pipeline": {"_class_name": "FluxPipeline", "max_sequence_length": 32},
    "transformer": {
        **_FLUX,
        "num_layers": 2,
        "num_single_layers": 2,
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "axes_dims_rope": [4, 6, 6],
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "sample_size": 32,
    },
    "vae": {
        **_FLUX_VAE,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "sample_size": 256,
    },
    "text_encoder": TINY_CLIP,
    "text_encoder_2": TINY_T5,
    "scheduler": _DEV_SCHED,
}
FULL_SIZE = ("flux-dev", "flux-schnell")
WEIGHTED = ("tiny-flux",)
