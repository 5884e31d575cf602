"""patchpar's Flax models against diffusers / transformers in fp32 (max abs diff <= 1e-4 of the
output's scale)."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from torch_refs import SDXL_POOLED, close, make_text_encoder, make_unet, make_vae, nchw, nhwc  # noqa: E402

from patchpar.models import load_text_encoder, load_unet, load_vae  # noqa: E402


@pytest.mark.parametrize(
    "kind",
    [
        "sd1",
        pytest.param("sd2", marks=pytest.mark.slow),
        pytest.param("sdxl", marks=pytest.mark.slow),
    ],
)
def test_unet_matches_diffusers(kind, tmp_path):
    ref = make_unet(kind)
    ref.save_pretrained(tmp_path)
    unet, params = load_unet(tmp_path)
    rng = np.random.RandomState(0)
    x = rng.randn(2, 16, 16, 4).astype(np.float32)
    ctx = rng.randn(2, 7, 24).astype(np.float32)
    t = np.array([10.0, 731.0], np.float32)
    added = {}
    if kind == "sdxl":
        added = {
            "text_embeds": rng.randn(2, SDXL_POOLED).astype(np.float32),
            "time_ids": np.array(
                [[128, 128, 0, 0, 128, 128], [96, 128, 8, 0, 128, 128]], np.float32
            ),
        }
    ours = jax.jit(unet)(params, x, t, ctx, **added)  # one program (op by op: ~300 compiles)
    with torch.no_grad():
        theirs = ref(
            nchw(x),
            torch.tensor(t),
            torch.tensor(ctx),
            added_cond_kwargs={k: torch.tensor(v) for k, v in added.items()} or None,
        ).sample
    close(ours, nhwc(theirs))


def test_vae_encoder_and_decoder_match_diffusers(tmp_path):
    ref = make_vae()
    ref.save_pretrained(tmp_path)
    vae, params = load_vae(tmp_path)
    rng = np.random.RandomState(0)
    images = rng.uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32)
    z = rng.randn(2, 16, 16, 4).astype(np.float32)
    mean, logvar = jax.jit(vae.encode)(params, images)
    decoded = jax.jit(vae)(params, z)
    with torch.no_grad():
        dist = ref.encode(nchw(images)).latent_dist
        ref_decoded = ref.decode(nchw(z)).sample
    close(mean, nhwc(dist.mean))
    close(logvar, nhwc(dist.logvar))
    close(decoded, nhwc(ref_decoded))
    assert vae.config.scaling_factor == pytest.approx(0.18215)


@pytest.mark.parametrize("projection, act", [(None, "quick_gelu"), (12, "gelu")])
def test_text_encoders_match_transformers(projection, act, tmp_path):
    ref = make_text_encoder(projection, act=act)
    ref.save_pretrained(tmp_path)
    fn, params = load_text_encoder(tmp_path)
    ids = np.random.RandomState(0).randint(0, 49406, (2, 77))
    ids[:, 0] = 49406
    ids[0, 9:] = 49407
    ids[1, 40:] = 49407
    out = jax.jit(fn)(params, ids)
    with torch.no_grad():
        theirs = ref(torch.tensor(ids), output_hidden_states=True)
    close(out["last_hidden_state"], theirs.last_hidden_state.numpy())
    close(out["hidden_states"][-2], theirs.hidden_states[-2].numpy())  # SDXL's penultimate layer
    if projection:
        close(out["text_embeds"], theirs.text_embeds.numpy())
    else:
        close(out["pooler_output"], theirs.pooler_output.numpy())
