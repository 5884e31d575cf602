"""The Flax FLUX.1 transformer against diffusers' FluxTransformer2DModel in fp32 (max abs diff
<= 1e-4 of the output's scale), on tiny random dev-like (guidance embedding) and schnell-like
configs, at a square and a non-square size; and its row patches equal to one device."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from torch_refs import close  # noqa: E402

from patchpar.models import load_denoiser  # noqa: E402
from patchpar.models.flux import FluxConfig, FluxFn, rope_table  # noqa: E402
from patchpar.models.loading import CheckpointError  # noqa: E402

DEV = dict(
    patch_size=1,
    in_channels=16,  # a 4-channel latent packed 2 x 2
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    pooled_projection_dim=20,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
SCHNELL = {**DEV, "guidance_embeds": False}


def make_flux(config: dict, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**config).eval()
    with torch.no_grad():  # diffusers' init leaves biases (and norm scales) plain: vary them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1, 0.1)
    return model


def pack(x):  # (B, H, W, C) -> diffusers' packed (B, H/2 * W/2, 4C)
    b, h, w, c = x.shape
    x = x.transpose(0, 3, 1, 2).reshape(b, c, h // 2, 2, w // 2, 2)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def image_ids(h, w):
    ids = np.zeros((h // 2, w // 2, 3), np.float32)
    ids[..., 1] = np.arange(h // 2)[:, None]
    ids[..., 2] = np.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


def reference(ref, x, t, ctx, pooled, guidance):
    b, h, w, c = x.shape
    with torch.no_grad():
        out = ref(
            hidden_states=torch.tensor(pack(x)),
            encoder_hidden_states=torch.tensor(ctx),
            pooled_projections=torch.tensor(pooled),
            timestep=torch.tensor(t),
            img_ids=torch.tensor(image_ids(h, w)),
            txt_ids=torch.zeros(ctx.shape[1], 3),
            guidance=None if guidance is None else torch.tensor(guidance),
        ).sample.numpy()
    # unpack (B, T, 4C) -> (B, H, W, C)
    out = out.reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
    return out.reshape(b, h, w, c)


def inputs(hw, guidance: bool, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(2, *hw, 4).astype(np.float32)
    t = np.array([0.03, 0.871], np.float32)  # sigmas, as diffusers' transformer takes them
    ctx = rng.randn(2, 5, 24).astype(np.float32)
    pooled = rng.randn(2, 20).astype(np.float32)
    g = np.array([3.5, 1.0], np.float32) if guidance else None
    return x, t, ctx, pooled, g


@pytest.mark.parametrize(
    "config, hw",
    [
        (DEV, (8, 8)),
        (DEV, (8, 12)),
        (SCHNELL, (8, 8)),
        pytest.param(SCHNELL, (12, 6), marks=pytest.mark.slow),
    ],
)
def test_flux_matches_diffusers(config, hw, tmp_path):
    """RoPE computed at the size given, the guidance embedding where the model has one."""
    ref = make_flux(config)
    ref.save_pretrained(tmp_path)
    fn, params = load_denoiser(tmp_path)
    assert isinstance(fn, FluxFn) and fn.config.guidance_embeds == config["guidance_embeds"]
    x, t, ctx, pooled, g = inputs(hw, config["guidance_embeds"])
    ours = jax.jit(fn)(params, x, t, ctx, pooled_projections=pooled, guidance=g)
    assert ours.shape == x.shape
    close(ours, reference(ref, x, t, ctx, pooled, g))


def test_a_folder_patchpar_writes_is_diffusers_own():
    """Parameters written by patchpar (the random presets' folders) carry diffusers' names:
    the state dict has exactly a FluxTransformer2DModel's keys and shapes."""
    from patchpar.models.loading import params_to_state_dict

    ref = make_flux(DEV)
    fn, _ = load_denoiser_from(ref)
    ours = params_to_state_dict(fn.init(seed=0))
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: v.shape for k, v in ours.items()} == theirs


def load_denoiser_from(ref):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        return load_denoiser(tmp)


def test_rope_table_matches_diffusers():
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    cfg = FluxConfig(attention_head_dim=16, axes_dims_rope=(4, 6, 6))
    cos, sin = FluxPosEmbed(10000, [4, 6, 6])(torch.tensor(image_ids(6, 10)))
    ours = rope_table(cfg, 3, 5)
    np.testing.assert_allclose(ours[:, :16], cos.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours[:, 16:], sin.numpy(), rtol=0, atol=1e-6)


def test_bad_flux_configs_are_named(tmp_path):
    base = {"_class_name": "FluxTransformer2DModel", **DEV}
    with pytest.raises(ValueError, match="patch_size=2 is not supported"):
        FluxConfig.from_diffusers({**base, "patch_size": 2})
    with pytest.raises(ValueError, match="in_channels=16, out_channels=8"):
        FluxConfig.from_diffusers({**base, "out_channels": 8})
    with pytest.raises(ValueError, match=r"axes_dims_rope=\[4, 6, 4\] must be 3 even sizes"):
        FluxConfig.from_diffusers({**base, "axes_dims_rope": [4, 6, 4]})
    ref = make_flux(DEV)
    ref.save_pretrained(tmp_path)
    fn, params = load_denoiser(tmp_path)
    x, t, ctx, pooled, _ = inputs((8, 8), False)
    with pytest.raises(ValueError, match="embeds the guidance scale"):
        fn(params, x, t, ctx, pooled_projections=pooled)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    for name, what in (
        ("QwenImageTransformer2DModel", "Qwen-Image"),
        ("HunyuanVideoTransformer3DModel", "HunyuanVideo"),
    ):
        path.write_text(json.dumps({**cfg, "_class_name": name}))
        with pytest.raises(CheckpointError, match=f"unsupported: {name} is {what}.*flux: "):
            load_denoiser(tmp_path)
