"""The VAE on several devices (patchpar/parallel/vae.py): row patches equal the one-device
decode and encode (<= 1e-4 of the output's scale, the engine's tolerance) on 2/4/8 fake devices,
with data splitting images, on rows the devices do not divide (uneven patches, padded), on the
tiny preset's VAE (SD's upsampling chain at small widths) and, slow, on the SD and SDXL VAE configs at full width; the tiled decode equals diffusers'
`tiled_decode`; bad input is refused naming what fits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from torch_refs import close, make_vae, nchw, nhwc

from patchpar.measure.comm import count_hlo, hlo_text_with_metadata
from patchpar.models.api import VAEFn
from patchpar.models.presets import PRESETS
from patchpar.models.vae import AutoencoderKL, VAEConfig
from patchpar.parallel.sites import record_sites
from patchpar.parallel.vae import VAEPlan, decode, encode, lowered_decode, tile_count


def _vae(preset: str, seed: int = 1) -> tuple[VAEFn, dict]:
    vae = VAEFn(AutoencoderKL(VAEConfig.from_diffusers(PRESETS[preset]["vae"]), jnp.float32))
    return vae, vae.init(seed)


def _latent(b: int, h: int, w: int, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (b, h, w, 4))


@pytest.fixture(scope="module")
def tiny():
    return _vae("tiny")


@pytest.mark.parametrize("devices, data, hw", [(2, 1, (16, 24)), (4, 1, (8, 8)),
                                               pytest.param(8, 1, (16, 8), marks=pytest.mark.slow),
                                               (4, 2, (16, 16)),
                                               (3, 1, (16, 24)),  # uneven: 6, 5, 5 rows
                                               (4, 1, (10, 16))])  # fmt: skip
def test_row_patches_decode_as_one_device(tiny, devices, data, hw):
    vae, params = tiny
    z = _latent(2, *hw)
    ref = decode(vae, params, z, VAEPlan())
    out = decode(vae, params, z, VAEPlan("rows", devices, data))
    assert out.shape == ref.shape == (2, hw[0] * 8, hw[1] * 8, 3)
    close(out, ref)


@pytest.mark.parametrize("devices", [2, 4, 3])  # 3: 8 latent rows as 3, 3, 2
def test_row_patches_encode_as_one_device(tiny, devices):
    vae, params = tiny
    images = jax.random.uniform(jax.random.key(3), (2, 64, 96, 3), minval=-1, maxval=1)
    mean, logvar = encode(vae, params, images, VAEPlan())
    m2, lv2 = encode(vae, params, images, VAEPlan("rows", devices))
    close(m2, mean)
    close(lv2, logvar)


@pytest.mark.parametrize("devices", [2, 4, 3])  # 3: uneven, 6, 5, 5 latent rows
def test_row_decode_bytes_from_hlo_equal_the_sites_analytic_models(tiny, devices):
    """The rows program's collectives are the sites' (halos, GroupNorm, ring hops), and the
    bytes the compiled program moves equal the sum of the sites' analytic models."""
    vae, params = tiny
    with record_sites() as calls:
        low = lowered_decode(vae, params, (2, 16, 16, 4), VAEPlan("rows", devices))
    hlo = count_hlo(hlo_text_with_metadata(low), devices)
    assert set(hlo.by_site) == {"halo", "gn", "kv"}
    analytic = [sum(op.received_bytes(info, p) for op, info in calls) for p in range(devices)]
    np.testing.assert_array_equal(hlo.per_device, analytic)


@pytest.mark.slow
def test_tiled_decode_equals_diffusers_tiled_decode(tmp_path):
    """diffusers' enable_tiling rule: same tiles, blends and crops, to float precision, on one
    device and spread over four (edge tiles of three shapes)."""
    import torch

    from patchpar.models import load_vae

    ref = make_vae()
    ref.save_pretrained(tmp_path)
    vae, params = load_vae(tmp_path)
    z = np.random.RandomState(0).randn(2, 40, 28, 4).astype(np.float32)
    ref.enable_tiling()
    with torch.no_grad():
        want = nhwc(ref.decode(nchw(z)).sample)
    assert tile_count((40, 28), vae.config.sample_size, 2) == 4 * 3
    for devices in (1, 4):
        close(decode(vae, params, z, VAEPlan("tiles", devices)), want)


@pytest.mark.slow
def test_tiles_differ_from_the_exact_decode(tiny):
    """Tiles normalise and attend within themselves: not the whole image's decode."""
    vae, params = tiny
    z = _latent(1, 16, 16)
    exact = np.asarray(decode(vae, params, z, VAEPlan()))
    tiled = np.asarray(decode(vae, params, z, VAEPlan("tiles", 4, tile=64)))
    assert tiled.shape == exact.shape
    assert np.abs(tiled - exact).max() > 1e-2


@pytest.mark.parametrize(
    "plan, hw, batch, message",
    [
        (VAEPlan("rows", 4), (3, 16), 1, "latent's 3 rows are fewer than the 4 row patches"),
        (VAEPlan("rows", 4, data=4), (16, 16), 4, "devices=4 / data=4 leaves 1"),
        (VAEPlan("rows", 4, data=2), (16, 16), 3, "3 image(s) do not split over data=2"),
        (
            VAEPlan("tiles", 2, tile=256),
            (16, 16),
            1,
            "vae_tile=256 is not smaller than the 128x128",
        ),
        (VAEPlan("tiles", 2, tile=60), (16, 16), 1, "multiple of the VAE factor 8"),
        (VAEPlan("tilted", 2), (16, 16), 1, "known: ['off', 'rows', 'tiles']"),
    ],
)
def test_bad_input_names_what_fits(tiny, plan, hw, batch, message):
    vae, _ = tiny
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):  # fmt: skip
        plan.validate(vae, hw, batch)


def test_a_pixel_space_model_has_no_vae_to_split():
    with pytest.raises(ValueError, match="no VAE"):
        VAEPlan("rows", 2).validate(None, (16, 16), 1)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["sd15", "sdxl"])
@pytest.mark.parametrize("devices, hw", [(2, (8, 12)), (4, (8, 8)), (8, (8, 8)), (8, (16, 8))])
def test_full_width_sd_and_sdxl_vae_rows_decode_as_one_device(preset, devices, hw):
    """The SD / SDXL VAE configs (128-512 channels, 32 groups, one 512-wide attention) at
    one and two latent rows per device."""
    vae, params = _vae(preset, seed=2)
    z = _latent(1, *hw, seed=devices)
    close(decode(vae, params, z, VAEPlan("rows", devices)), decode(vae, params, z, VAEPlan()))
