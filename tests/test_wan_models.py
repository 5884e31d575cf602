"""The Flax Wan transformer against diffusers' WanTransformer3DModel in fp32 (max abs diff
<= 1e-4 of the output's scale) on tiny random configs, with the video laid out as a tall image
in every layout (frames, rows, a frame x row grid): the same output, frame by frame; and its
3-D RoPE against diffusers'."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from torch_refs import close  # noqa: E402

from patchpar.models.loading import state_dict_to_params  # noqa: E402
from patchpar.models.wan.model import (  # noqa: E402
    Video,
    WanConfig,
    WanTransformer3DModel,
    rope_table,
)

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,  # RoPE parts t, h, w: 4, 4, 4
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=40,
    num_layers=2,
    cross_attn_norm=True,
    rope_max_seq_len=64,
)


def make_wan(config: dict, seed: int = 0):
    from diffusers import WanTransformer3DModel as Ref

    torch.manual_seed(seed)
    model = Ref(**config).eval()
    with torch.no_grad():  # diffusers' init leaves biases and norm scales plain: vary them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1, 0.1)
    return model


def flax_wan(ref, video: Video):
    module = WanTransformer3DModel(WanConfig.from_diffusers(dict(ref.config)), video)
    x = jnp.zeros((1, video.frames * 8, 6, 4))
    abstract = jax.eval_shape(
        lambda: module.init(jax.random.PRNGKey(0), x, jnp.zeros(1), jnp.zeros((1, 3, 16)))
    )["params"]
    state = {
        k.replace("blocks.", "transformer_blocks.", 1) if k.startswith("blocks.") else k:
        v.numpy() for k, v in ref.state_dict().items()
    }  # fmt: skip
    return module, state_dict_to_params(state, abstract, "test")


def inputs(frames=3, hw=(8, 6), seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(2, frames, *hw, 4).astype(np.float32)  # (B, F, H, W, C)
    t = np.array([999.0, 321.5], np.float32)
    ctx = rng.randn(2, 5, 16).astype(np.float32)
    return x, t, ctx


def reference(ref, x, t, ctx):
    with torch.no_grad():
        out = ref(
            hidden_states=torch.tensor(x.transpose(0, 4, 1, 2, 3)),
            timestep=torch.tensor(t),
            encoder_hidden_states=torch.tensor(ctx),
        ).sample.numpy()
    return out.transpose(0, 2, 3, 4, 1)  # (B, F, H, W, C)


@pytest.mark.parametrize("layout", ["frames", pytest.param("rows", marks=pytest.mark.slow), "3x2"])
def test_wan_matches_diffusers_in_every_layout(layout):
    ref = make_wan(TINY)
    x, t, ctx = inputs()
    want = reference(ref, x, t, ctx)
    video = Video(frames=3, layout=layout)
    module, params = flax_wan(ref, video)
    tall = video.to_tall(jnp.asarray(x), 2)
    out = jax.jit(module.apply)({"params": params}, tall, t, ctx)
    assert out.shape == tall.shape
    close(video.from_tall(out, 2), want)


def test_layouts_are_permutations_of_whole_tokens():
    x = jnp.arange(2 * 3 * 8 * 2 * 1).reshape(2, 3, 8, 2, 1).astype(jnp.float32)
    for layout in ("frames", "rows", "3x2", "1x4"):
        video = Video(3, layout)
        tall = video.to_tall(x, 2)
        np.testing.assert_array_equal(video.from_tall(tall, 2), x)
    rows = Video(3, "rows").to_tall(x, 2)  # token row 0 of every frame first
    np.testing.assert_array_equal(rows[:, 2:4], x[:, 1, 0:2])
    np.testing.assert_array_equal(Video(3, "frames").to_tall(x, 2)[:, 8:16], x[:, 1])


def test_rope_table_matches_diffusers():
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    cfg = WanConfig.from_diffusers(TINY)
    rope = WanRotaryPosEmbed(12, (1, 2, 2), 64)
    cos, sin = rope(torch.zeros(1, 4, 3, 8, 10))  # 3 frames of 4 x 5 tokens
    ours = rope_table(cfg, Video(3), 12, 5)
    np.testing.assert_allclose(ours[:, :12], cos[0, :, 0].numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours[:, 12:], sin[0, :, 0].numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"image_dim": 1280}, "image_dim=1280 is an image-to-video transformer"),
        ({"patch_size": [2, 2, 2]}, r"patch_size=\[2, 2, 2\] is not supported"),
        ({"patch_size": 2}, r"patch_size=2 is not supported: patchpar runs Wan's \(1, p, p\)"),
        ({"qk_norm": "rms_norm"}, "qk_norm='rms_norm' is not supported"),
        ({"_class_name": "FluxTransformer2DModel"}, "is not a Wan transformer"),
    ],
)
def test_bad_wan_configs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        WanConfig.from_diffusers({**TINY, **change})


def test_umt5_encoder_matches_transformers(tmp_path):
    """umT5 (Wan's text encoder): a relative position bias table in every block; 40 tokens,
    beyond the buckets' max distance, each prompt its own padding."""
    from transformers import UMT5Config, UMT5EncoderModel

    from patchpar.models.components import load_t5_encoder

    torch.manual_seed(0)
    cfg = UMT5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=3, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=12,
                     feed_forward_proj="gated-gelu", dropout_rate=0.0)  # fmt: skip
    ref = UMT5EncoderModel(cfg).eval()
    with torch.no_grad():  # each block's own table, not the first's copied
        for name, p in ref.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_(0, 1.0)
    ref.save_pretrained(tmp_path)
    fn, params = load_t5_encoder(tmp_path)
    assert fn.config.bias_per_layer
    rng = np.random.RandomState(0)
    ids = rng.randint(3, 99, (2, 40)).astype(np.int32)
    mask = np.ones((2, 40), np.int32)
    mask[1, 9:] = 0
    ids[mask == 0] = 0
    ours = jax.jit(fn)(params, ids, mask)["last_hidden_state"]
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor(ids, dtype=torch.long),
                     attention_mask=torch.tensor(mask)).last_hidden_state.numpy()  # fmt: skip
    close(ours, theirs)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match=r"layout='diagonal'; known: \['frames', 'rows'\] or FxR"):
        Video(3, "diagonal")


# ---------------------------------------------------------------------------- the VAE decoder

TINY_VAE = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                temperal_downsample=[False, True, True])  # fmt: skip


def flax_wan_vae(ref):
    from patchpar.models.wan.vae import WanVAEConfig, WanVAEDecoder

    module = WanVAEDecoder(WanVAEConfig.from_diffusers(dict(ref.config)))
    z = jnp.zeros((1, 1, 4, 6, module.config.z_dim))
    abstract = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), z))["params"]
    state = {k: v.numpy() for k, v in ref.state_dict().items()
             if k.startswith(("decoder.", "post_quant_conv."))}  # fmt: skip
    return module, state_dict_to_params(state, abstract, "test")


# Wan 2.2 TI2V-5B's layout: residual up blocks (the channel-repeating shortcut), a decoder wider
# than the encoder, 12 channels out = 2 x 2 pixels of RGB: 16x spatially
TINY_VAE22 = dict(TINY_VAE, base_dim=8, decoder_base_dim=12, z_dim=6, is_residual=True,
                  patch_size=2, in_channels=12, out_channels=12)  # fmt: skip


@pytest.mark.parametrize(
    "frames, config",
    [pytest.param(1, TINY_VAE, marks=pytest.mark.slow), (3, TINY_VAE), (3, TINY_VAE22)],
    ids=["1-wan2.1", "3-wan2.1", "3-wan2.2"],
)
def test_wan_vae_decode_matches_diffusers(frames, config):
    """Chunk by chunk with causal caches (the first latent frame one frame, each later one 4),
    two temporal and three spatial upsamplings, the middle block's per-frame attention; Wan
    2.2's residual decoder and its 2 x 2 unpatchify (16x)."""
    from diffusers import AutoencoderKLWan

    from patchpar.models.wan.vae import decode

    torch.manual_seed(0)
    ref = AutoencoderKLWan(**config).eval()
    with torch.no_grad():  # norm scales and biases away from their plain init
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.normal_(1, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    z = np.random.RandomState(0).randn(2, frames, 4, 6, config["z_dim"]).astype(np.float32)
    with torch.no_grad():
        want = ref.decode(torch.tensor(z.transpose(0, 4, 1, 2, 3))).sample.numpy()
    want = want.transpose(0, 2, 3, 4, 1)  # (B, F', H, W, 3)
    module, params = flax_wan_vae(ref)
    got = jax.jit(lambda p, z: decode(module, p, z))(params, jnp.asarray(z))
    f = module.config.spatial_factor
    assert f == (16 if config.get("patch_size") else 8)
    assert got.shape == want.shape == (2, 1 + 4 * (frames - 1), 4 * f, 6 * f, 3)
    assert (np.abs(want) < 0.99).mean() > 0.5  # not clipped
    close(got, want)


@pytest.mark.parametrize(
    "devices, data, config",
    [
        (4, 1, TINY_VAE),
        pytest.param(4, 2, TINY_VAE, marks=pytest.mark.slow),
        pytest.param(4, 1, TINY_VAE22, marks=pytest.mark.slow),
    ],  # fmt: skip
)
def test_wan_vae_decode_on_row_patches_equals_one_device(devices, data, config):
    """Every frame's rows over the patch devices (6 latent rows: 2, 2, 1, 1 on 4, padded; 3 per
    image on 2 x 2 with data 2), exact halos after each upsampling, the per-frame attention over
    every patch (Ring), the causal caches per device (Wan 2.2's residual decoder: its shortcut
    and unpatchify are per pixel): the one-device frames within float32 rounding."""
    from patchpar.models.wan import WanVAEFn
    from patchpar.models.wan.vae import WanVAEConfig, WanVAEDecoder
    from patchpar.parallel.mesh import to_local
    from patchpar.parallel.vae import VAEPlan, decode_video

    fn = WanVAEFn(WanVAEDecoder(WanVAEConfig.from_diffusers(config)))
    rng = np.random.RandomState(0)
    params = jax.tree.map(lambda p: p * 0.5 + 0.05 * rng.randn(*p.shape), fn.init(seed=2))
    z = jnp.asarray(rng.randn(2, 3, 6, 4, config["z_dim"]).astype(np.float32))  # (B, F, h, w, z)
    one = np.asarray(decode_video(fn, params, z, VAEPlan()))
    f = fn.config.spatial_factor
    assert one.shape == (2, 9, 6 * f, 4 * f, 3) and (np.abs(one) < 0.99).mean() > 0.5  # unclipped
    got = np.asarray(to_local(decode_video(fn, params, z, VAEPlan("rows", devices, data))))
    assert np.abs(got - one).max() <= 1e-5 * np.abs(one).max()
