"""Component configs that several families' presets share: the SD schedulers and VAEs, CLIP-L,
T5 v1.1 XXL, and their tiny test sizes (diffusers / transformers config.json contents)."""

SD_SCHEDULER = {
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
SD_VAE = {
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
CLIP_L = {
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

T5_XXL = {
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
TINY_T5 = {  # a 2-layer T5 of width 32 over a 256-piece sentencepiece vocabulary
    **T5_XXL,
    "d_model": 32,
    "d_ff": 64,
    "d_kv": 8,
    "num_heads": 4,
    "num_layers": 2,
    "vocab_size": 256,
}
TINY_CLIP = {
    **CLIP_L,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
TINY_VAE = {
    **SD_VAE,
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "sample_size": 256,
}
# The text a random-weight preset's T5 tokenizer is trained on (sentencepiece, offline).
TOKENIZER_TEXT = [
    "a photo of a cat sitting on a wooden table",
    "an astronaut riding a horse on the moon, highly detailed",
    "a red trouser, a blue pullover and a white sneaker",
    "a bag, an ankle boot, a sandal, a shirt, a coat and a dress",
    "a small house by a lake at sunset, oil painting",
    "two dogs playing in the snow, watercolor",
    "a city street at night in the rain with neon lights",
    "a bowl of fruit: apples, oranges and bananas",
]
