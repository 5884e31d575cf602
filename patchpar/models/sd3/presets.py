"""The SD3 family's presets: the diffusers configs of Stable Diffusion 3 medium and 3.5 medium
and large (full shapes, for abstract lowering without weights) and `tiny-sd3` (an SD3.5-medium-like test size:
a dual-attention block, QK RMSNorm, the context_pre_only last block; written with random
weights on first use)."""

from patchpar.models.configs import CLIP_L, SD_VAE, T5_XXL, TINY_CLIP, TINY_T5

# SD3.5 (stabilityai, diffusers folders): joint blocks of width 64 x heads, QK RMSNorm; medium has
# 24 blocks of 24 heads, the first 13 with a second (image-only) attention, and positions for
# 384^2 tokens; large has 38 blocks of 38 heads. CLIP-L and CLIP-G (both projected: the pooled
# 768 + 1280) and T5 v1.1 XXL (256 tokens by default).
_SD35 = {
    "_class_name": "SD3Transformer2DModel",
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "attention_head_dim": 64,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 2048,
    "qk_norm": "rms_norm",
}
_SD3_MEDIUM = {  # Stable Diffusion 3 medium (2B): no QK norm, no dual attention
    **_SD35,
    "num_layers": 24,
    "num_attention_heads": 24,
    "caption_projection_dim": 1536,
    "pos_embed_max_size": 192,
    "qk_norm": None,
}
_MEDIUM = {
    **_SD35,
    "num_layers": 24,
    "num_attention_heads": 24,
    "caption_projection_dim": 1536,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),
}
_LARGE = {
    **_SD35,
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "pos_embed_max_size": 192,
}
# The 16-channel VAE: SD's shape, no quant convs, latents shifted then scaled.
_SD3_VAE = {
    **SD_VAE,
    "latent_channels": 16,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "sample_size": 1024,
}
_CLIP_L = {**CLIP_L, "architectures": ["CLIPTextModelWithProjection"], "projection_dim": 768}
_CLIP_G = {  # OpenCLIP bigG, as SDXL's second encoder
    **CLIP_L,
    "architectures": ["CLIPTextModelWithProjection"],
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "hidden_act": "gelu",
    "projection_dim": 1280,
}
# Flow matching with shift 3, the sigmas from the scheduler's own range (the pipeline passes none)
_SCHED = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
          "shift": 3.0}  # fmt: skip

PRESETS: dict[str, dict[str, dict]] = {
    name: {
        "pipeline": {"_class_name": "StableDiffusion3Pipeline"},
        "transformer": transformer,
        "vae": _SD3_VAE,
        "text_encoder": _CLIP_L,
        "text_encoder_2": _CLIP_G,
        "text_encoder_3": T5_XXL,
        "scheduler": _SCHED,
    }
    for name, transformer in (
        ("sd3-medium", _SD3_MEDIUM),
        ("sd3.5-medium", _MEDIUM),
        ("sd3.5-large", _LARGE),
    )
}
_TINY_CLIP = {**TINY_CLIP, "architectures": ["CLIPTextModelWithProjection"], "projection_dim": 16}
PRESETS["tiny-sd3"] = {  # SD3.5-medium-like: block 0 dual, QK RMSNorm, 3 blocks
    "pipeline": {"_class_name": "StableDiffusion3Pipeline", "max_sequence_length": 32},
    "transformer": {
        **_MEDIUM,
        "num_layers": 3,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "caption_projection_dim": 32,
        "joint_attention_dim": 64,  # T5's width; the CLIP states (32 + 32) are padded to it
        "pooled_projection_dim": 32,  # the two CLIP projections, 16 + 16
        "pos_embed_max_size": 48,
        "sample_size": 32,
        "dual_attention_layers": [0],
    },
    "vae": {
        **_SD3_VAE,
        "block_out_channels": [16, 32, 32, 32],
        "layers_per_block": 1,
        "norm_num_groups": 8,
        "sample_size": 256,
    },
    "text_encoder": _TINY_CLIP,
    "text_encoder_2": _TINY_CLIP,
    "text_encoder_3": {**TINY_T5, "d_model": 64},
    "scheduler": _SCHED,
}
FULL_SIZE = ("sd3-medium", "sd3.5-medium", "sd3.5-large")
WEIGHTED = ("tiny-sd3",)
