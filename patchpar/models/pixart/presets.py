"""The PixArt family's presets: the diffusers configs of PixArt-α and PixArt-Σ XL-2 1024-MS (full
shapes, for abstract lowering without weights) and `tiny-dit` (a PixArt-α-like test size,
written with random weights on first use)."""

from patchpar.models.configs import SD_VAE, T5_XXL, TINY_T5, TINY_VAE

PRESETS: dict[str, dict[str, dict]] = {}
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
    "vae": {**SD_VAE, "sample_size": 1024},
    "text_encoder": T5_XXL,
    "scheduler": _PIXART_SCHED,
}
PRESETS["pixart-sigma"] = {
    "pipeline": {"_class_name": "PixArtSigmaPipeline"},
    "transformer": {**_PIXART, "interpolation_scale": 2, "use_additional_conditions": False},
    "vae": {**SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025},
    "text_encoder": T5_XXL,
    "scheduler": _PIXART_SCHED,
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
    "vae": TINY_VAE,
    "text_encoder": TINY_T5,
    "scheduler": _PIXART_SCHED,
}
FULL_SIZE = ("pixart-alpha", "pixart-sigma")
WEIGHTED = ("tiny-dit",)
# The T5 tokens each PixArt pipeline reads (diffusers' `max_sequence_length` defaults).
MAX_TEXT_TOKENS = {"PixArtAlphaPipeline": 120, "PixArtSigmaPipeline": 300}
