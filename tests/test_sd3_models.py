"""The Flax SD3 transformer against diffusers' SD3Transformer2DModel in fp32 (max abs diff <= 1e-4
of the output's scale), on tiny random SD3-like (no QK norm, no dual attention) and SD3.5-like
(QK RMSNorm, dual-attention blocks) configs, at a square and a non-square size; the folders
patchpar writes are diffusers' own; bad configs are one-line errors."""

import re

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from torch_refs import close  # noqa: E402

from patchpar.models import load_denoiser  # noqa: E402
from patchpar.models.sd3 import FAMILY, SD3Config, SD3Fn  # noqa: E402

SD3 = dict(
    sample_size=8,
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=3,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=24,
    caption_projection_dim=16,
    pooled_projection_dim=20,
    pos_embed_max_size=12,
)
SD35 = {**SD3, "qk_norm": "rms_norm", "dual_attention_layers": (0, 1)}


def make_sd3(config: dict, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**config).eval()
    with torch.no_grad():  # diffusers' init leaves biases (and norm scales) plain: vary them
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1, 0.1)
    return model


def reference(ref, x, t, ctx, pooled):
    with torch.no_grad():
        out = ref(
            hidden_states=torch.tensor(x.transpose(0, 3, 1, 2)),
            encoder_hidden_states=torch.tensor(ctx),
            pooled_projections=torch.tensor(pooled),
            timestep=torch.tensor(t * 1000),
        ).sample.numpy()
    return out.transpose(0, 2, 3, 1)


def inputs(hw, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(2, *hw, 4).astype(np.float32)
    t = np.array([0.03, 0.871], np.float32)  # sigmas (the transformer gets sigma x 1000)
    ctx = rng.randn(2, 5, 24).astype(np.float32)
    pooled = rng.randn(2, 20).astype(np.float32)
    return x, t, ctx, pooled


@pytest.mark.parametrize(
    "config, hw",
    [(SD3, (8, 8)), (SD35, (8, 8)), (SD35, (8, 12)), pytest.param(SD3, (12, 6),
                                                                  marks=pytest.mark.slow)],
)  # fmt: skip
def test_sd3_matches_diffusers(config, hw, tmp_path):
    """The position table cropped at the size given; dual attention and QK norm where the
    config has them; the last block context_pre_only."""
    ref = make_sd3(config)
    ref.save_pretrained(tmp_path)
    fn, params = load_denoiser(tmp_path)
    assert isinstance(fn, SD3Fn) and fn.config.dual_attention_layers == tuple(
        config.get("dual_attention_layers", ())
    )
    x, t, ctx, pooled = inputs(hw)
    ours = jax.jit(fn)(params, x, t, ctx, pooled_projections=pooled)
    assert ours.shape == x.shape
    close(ours, reference(ref, x, t, ctx, pooled))


def test_a_folder_patchpar_writes_is_diffusers_own(tmp_path):
    """A random folder patchpar writes has exactly an SD3Transformer2DModel's keys and shapes
    (the position table included), and diffusers loads it to the same outputs."""
    from diffusers import SD3Transformer2DModel
    from safetensors.numpy import load_file

    ref = make_sd3(SD35)
    preset = {"transformer": {"_class_name": "SD3Transformer2DModel", **SD35}}
    fn = FAMILY.denoiser(preset["transformer"], "transformer")
    params = fn.init(seed=3)
    from patchpar.models.loading import params_to_state_dict, write_component

    write_component(tmp_path, preset["transformer"], params)
    ours = params_to_state_dict(params)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert set(theirs) - set(ours) == {"pos_embed.pos_embed"}
    assert {k: v.shape for k, v in ours.items()} == {
        k: v for k, v in theirs.items() if k != "pos_embed.pos_embed"
    }
    # diffusers' own table equals the one patchpar computes (and checks on loading)
    table = load_file(str(_saved(ref, tmp_path / "ref")))["pos_embed.pos_embed"]
    from patchpar.models.sd3.model import sincos_grid

    cfg = fn.config
    np.testing.assert_allclose(
        table.reshape(cfg.pos_embed_max_size, cfg.pos_embed_max_size, -1),
        sincos_grid(cfg.inner_dim, cfg.pos_embed_max_size, cfg.sample_size // cfg.patch_size),
        atol=1e-6,
    )
    # the positions a grid takes are the whole table's centre crop, bit for bit (computed
    # without the whole table)
    from patchpar.models.sd3.model import position_table

    m = cfg.pos_embed_max_size
    whole = sincos_grid(cfg.inner_dim, m, cfg.sample_size // cfg.patch_size)
    for rows, cols in ((m, m), (2, m), (3, 1)):
        top, left = (m - rows) // 2, (m - cols) // 2
        crop = whole[top : top + rows, left : left + cols].reshape(rows * cols, -1)
        np.testing.assert_array_equal(position_table(cfg, rows, cols), crop)
    del SD3Transformer2DModel


def _saved(model, folder):
    model.save_pretrained(folder)
    return folder / "diffusion_pytorch_model.safetensors"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"dual_attention_layers": (0, 7)}, "dual_attention_layers has index(es) [7] outside"),
        ({"qk_norm": "layer_norm"}, "qk_norm='layer_norm' is not supported"),
        ({"caption_projection_dim": 24}, "caption_projection_dim=24 must equal the width"),
        ({"_class_name": "FluxTransformer2DModel"}, "is not SD3Transformer2DModel"),
    ],
)
def test_bad_configs_are_one_line_errors(change, words):
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        SD3Config.from_diffusers({**SD35, **change})
    assert "\n" not in str(e.value)


def test_a_latent_larger_than_the_positions_is_refused():
    from patchpar.models.sd3.model import position_table

    cfg = SD3Config.from_diffusers(SD35)
    with pytest.raises(ValueError, match="larger than the model's positions"):
        position_table(cfg, 13, 4)
