"""The UNet family's presets: the diffusers configs of SD 1.5, SD 2.1 and SDXL (full shapes, for
abstract lowering without weights), `tiny` / `tiny-xl` (SD-like and SDXL-like test and
quick-start sizes, written with random weights on first use) and `fmnist-random` (the trained
`fmnist` model's architecture with random weights)."""

from patchpar.models.configs import CLIP_L, SD_SCHEDULER, SD_VAE, TINY_CLIP, TINY_VAE

UNET_SD = {
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
PRESETS: dict[str, dict[str, dict]] = {
    "sd15": {
        "unet": {
            **UNET_SD,
            "sample_size": 64,
            "attention_head_dim": 8,
            "cross_attention_dim": 768,
        },
        "vae": {**SD_VAE, "sample_size": 512},
        "text_encoder": CLIP_L,
        "scheduler": SD_SCHEDULER,
    },
    "sd21": {
        "unet": {
            **UNET_SD,
            "sample_size": 96,
            "attention_head_dim": [5, 10, 20, 20],
            "cross_attention_dim": 1024,
            "use_linear_projection": True,
        },
        "vae": {**SD_VAE, "sample_size": 768},
        "text_encoder": {
            **CLIP_L,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 23,
            "num_attention_heads": 16,
            "hidden_act": "gelu",
        },
        "scheduler": {**SD_SCHEDULER, "prediction_type": "v_prediction"},
    },
    "sdxl": {
        "unet": {
            **UNET_SD,
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
        "vae": {**SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025},
        "text_encoder": CLIP_L,
        "text_encoder_2": {
            **CLIP_L,
            "architectures": ["CLIPTextModelWithProjection"],
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_attention_heads": 20,
            "hidden_act": "gelu",
            "projection_dim": 1280,
        },
        "scheduler": {**SD_SCHEDULER, "timestep_spacing": "leading"},
    },
}

PRESETS["tiny"] = {
    "unet": {
        **UNET_SD,
        "sample_size": 32,
        "block_out_channels": [32, 64, 64],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "attention_head_dim": 4,
        "cross_attention_dim": 32,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    },
    "vae": TINY_VAE,
    "text_encoder": TINY_CLIP,
    "scheduler": SD_SCHEDULER,
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
    "vae": {**TINY_VAE, "scaling_factor": 0.13025},
    "text_encoder": TINY_CLIP,
    "text_encoder_2": {
        **TINY_CLIP,
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
    "text_encoder": TINY_CLIP,
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

FULL_SIZE = ("sd15", "sd21", "sdxl")
WEIGHTED = ("tiny", "tiny-xl", "fmnist-random")  # random weights, written on first use
