"""Tiny random PyTorch reference models (diffusers / transformers), saved with save_pretrained."""

from __future__ import annotations

import numpy as np
import torch


def rel_err(ours, theirs) -> float:
    """Max abs difference relative to the reference's largest magnitude."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def close(ours, ref, rel=1e-4):
    """Parity: max abs diff <= rel x the reference output's scale (max |ref|)."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel} x output scale {scale:.3g}"


UNET_KINDS = {
    "sd1": dict(
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        attention_head_dim=4,
        layers_per_block=1,
    ),
    "sd2": dict(
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        layers_per_block=1,
    ),
    "sdxl": dict(
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(32, 64, 64),
        attention_head_dim=(2, 4, 4),
        use_linear_projection=True,
        transformer_layers_per_block=(1, 2, 2),
        layers_per_block=2,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=16 + 6 * 8,
    ),
}
SDXL_POOLED = 16


def jitter(module: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """Perturb every parameter so zero-initialised biases and unit norms are exercised too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module.eval()


def make_unet(kind: str, cross_attention_dim: int = 24, seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    m = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        norm_num_groups=8,
        cross_attention_dim=cross_attention_dim,
        **UNET_KINDS[kind],
    )
    return jitter(m, seed)


def make_vae(seed: int = 0, scaling_factor: float = 0.18215):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    m = AutoencoderKL(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=32,
        scaling_factor=scaling_factor,
    )
    return jitter(m, seed)


def make_text_encoder(
    projection_dim: int | None = None,
    hidden: int = 24,
    act: str = "quick_gelu",
    seed: int = 0,
    vocab: int = 49408,
):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act=act,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=49407,
    )
    if projection_dim is None:
        return jitter(CLIPTextModel(CLIPTextConfig(**kw)), seed)
    return jitter(
        CLIPTextModelWithProjection(CLIPTextConfig(projection_dim=projection_dim, **kw)), seed
    )


def nchw(x):
    return torch.tensor(x).permute(0, 3, 1, 2).contiguous()


def nhwc(t):
    return t.detach().permute(0, 2, 3, 1).numpy()


# Small Flax-only configs for the parallel-engine tests (compile time grows with depth).
MICRO_UNETS = {
    "sd": {
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": [16, 32],
        "layers_per_block": 1,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "attention_head_dim": 2,
        "cross_attention_dim": 16,
        "norm_num_groups": 4,
        "sample_size": 16,
    },
    "sdxl": {
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": [16, 32],
        "layers_per_block": 1,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "attention_head_dim": [2, 4],
        "transformer_layers_per_block": [1, 2],
        "use_linear_projection": True,
        "cross_attention_dim": 16,
        "norm_num_groups": 4,
        "sample_size": 16,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 4,
        "projection_class_embeddings_input_dim": 8 + 6 * 4,
    },
}
