"""The Wan family's presets: the diffusers configs of Wan 2.1 T2V 1.3B and 14B and Wan 2.2 TI2V
5B (full shapes, for abstract lowering without weights) and `tiny-wan` (Wan 2.1's layout at a
test size: a causal video VAE of two temporal upsamplings, umT5 with a bias table per block;
written with random weights on first use).

A transformer config may carry `sample_height`, `sample_width` and `sample_frames`: the video a
pipeline makes unless told (pixels and frames; diffusers ignores the keys). Without them it is
WanPipeline's default, 480 x 832 and 81 frames."""

from patchpar.models.configs import T5_XXL, TINY_T5

# Wan 2.1 T2V (Wan-AI, diffusers folders): 1 x 2 x 2 patches of a 16-channel latent, heads of 128,
# QK RMSNorm over all heads, umT5-XXL text (4096 wide).
_WAN = {
    "_class_name": "WanTransformer3DModel",
    "patch_size": [1, 2, 2],
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
    "image_dim": None,
    "added_kv_proj_dim": None,
}
_WAN_1_3B = {**_WAN, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
_WAN_14B = {**_WAN, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# Wan 2.2 TI2V 5B: a 48-channel latent of its residual VAE (16x spatial), 24 heads
_WAN22_5B = {**_WAN, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30,
             "in_channels": 48, "out_channels": 48}  # fmt: skip

# Wan 2.1's VAE (AutoencoderKLWan): 8x spatial, 4x temporal (causal), z 16, per-channel latent
# statistics; the pipeline un-normalises latents with them before decoding.
_VAE = {
    "_class_name": "AutoencoderKLWan",
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916],
}  # fmt: skip
# Wan 2.2's residual VAE (16x spatial: 8x by its up blocks, 2 x 2 pixels per decoder position of
# 12 channels; z 48); its latent statistics here are placeholders (a folder has its own)
_VAE22 = {**_VAE, "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "is_residual": True,
          "patch_size": 2, "in_channels": 12, "out_channels": 12, "scale_factor_spatial": 16,
          "scale_factor_temporal": 4,
          "latents_mean": [0.0] * 48,
          "latents_std": [1.0] * 48}  # fmt: skip
_UMT5_XXL = {
    **T5_XXL,
    "architectures": ["UMT5EncoderModel"],
    "model_type": "umt5",
    "vocab_size": 256384,
    "tie_word_embeddings": False,
}
# Flow UniPC (bh2, order 2) with flow shift 3, as Wan 2.1's folders hold it (Wan's advice: 3 at
# 480p, 5 at 720p, set in the folder's scheduler config; Wan 2.2 5B's folder holds 5)
_SCHED = {
    "_class_name": "UniPCMultistepScheduler",
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "predict_x0": True,
    "lower_order_final": True,
    "final_sigmas_type": "zero",
    "timestep_spacing": "linspace",
}

PRESETS: dict[str, dict[str, dict]] = {
    name: {
        "pipeline": {"_class_name": "WanPipeline", **index},
        "transformer": transformer,
        "vae": vae,
        "text_encoder": _UMT5_XXL,
        "scheduler": {**_SCHED, "flow_shift": shift},
    }
    for name, transformer, vae, index, shift in (
        ("wan2.1-1.3b", _WAN_1_3B, _VAE, {}, 3.0),
        ("wan2.1-14b", _WAN_14B, _VAE, {}, 3.0),
        (
            "wan2.2-5b",
            {**_WAN22_5B, "sample_height": 704, "sample_width": 1280, "sample_frames": 121},
            _VAE22,
            {"expand_timesteps": True},
            5.0,
        ),
    )  # fmt: skip
}
PRESETS["tiny-wan"] = {  # Wan 2.1's layout: 2 blocks of 2 heads x 12, a 4-channel latent
    "pipeline": {"_class_name": "WanPipeline", "max_sequence_length": 16},
    "transformer": {
        **_WAN_1_3B,
        "num_attention_heads": 2,
        "attention_head_dim": 12,  # RoPE parts t, h, w: 4, 4, 4
        "in_channels": 4,
        "out_channels": 4,
        "text_dim": 32,
        "freq_dim": 32,
        "ffn_dim": 48,
        "num_layers": 2,
        "rope_max_seq_len": 64,
        "sample_height": 64,
        "sample_width": 64,
        "sample_frames": 5,
    },
    "vae": {
        **_VAE,
        "base_dim": 16,
        "z_dim": 4,
        "dim_mult": [1, 2, 2, 2],
        "num_res_blocks": 1,
        "latents_mean": [0.1, -0.2, 0.05, 0.0],
        "latents_std": [1.5, 0.8, 1.2, 1.0],
    },
    "text_encoder": {**TINY_T5, "architectures": ["UMT5EncoderModel"], "model_type": "umt5"},
    "scheduler": _SCHED,
}
# fmnist-video's architecture with random weights: a pixel-space Wan (no VAE: the "latent" is the
# grey video in [-1, 1]) of 32 x 32 frames, 8 of them; 8 x 8 pixel patches (16 tokens a frame),
# 6 blocks of 4 heads x 24 (RoPE parts t, h, w: 8, 8, 8), umT5 of width 32 (experiments/
# train_fmnist_video.py trains both)
PRESETS["fmnist-video-random"] = {
    "pipeline": {"_class_name": "WanPipeline", "max_sequence_length": 16},
    "transformer": {
        **_WAN_1_3B,
        "patch_size": [1, 8, 8],
        "num_attention_heads": 4,
        "attention_head_dim": 24,
        "in_channels": 1,
        "out_channels": 1,
        "text_dim": 32,
        "freq_dim": 64,
        "ffn_dim": 256,
        "num_layers": 6,
        "rope_max_seq_len": 64,
        "sample_height": 32,
        "sample_width": 32,
        "sample_frames": 8,
    },
    "text_encoder": {**TINY_T5, "architectures": ["UMT5EncoderModel"], "model_type": "umt5"},
    "scheduler": {**_SCHED, "flow_shift": 1.0},
}
FULL_SIZE = ("wan2.1-1.3b", "wan2.1-14b", "wan2.2-5b")
WEIGHTED = ("tiny-wan", "fmnist-video-random")
