"""Whole pipeline against diffusers: same prompt embeddings, and the same final latent given the
same initial latent and text embeddings (<= 1e-3)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import jax.numpy as jnp  # noqa: E402
from torch_refs import make_text_encoder, make_unet, make_vae, nchw, nhwc, rel_err  # noqa: E402

from patchpar.models.tokenizer import write_clip_tokenizer  # noqa: E402
from patchpar.pipelines import Conditioning, load_pipeline  # noqa: E402

PROMPTS = ["a photo of a red bag", "a cat on a mat"]
SCHEDULERS = {
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
}


def sd_scheduler():
    return diffusers.DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    from transformers import CLIPTokenizer

    folder = tmp_path_factory.mktemp("sd")
    tok = CLIPTokenizer.from_pretrained(str(write_clip_tokenizer(folder / "tok_src")))
    pipe = diffusers.StableDiffusionPipeline(
        vae=make_vae(1),
        text_encoder=make_text_encoder(seed=2),
        tokenizer=tok,
        unet=make_unet("sd1", cross_attention_dim=24, seed=3),
        scheduler=sd_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder / "pipe")
    return folder / "pipe", pipe


@pytest.fixture(scope="module")
def sdxl_folder(tmp_path_factory):
    from transformers import CLIPTokenizer

    folder = tmp_path_factory.mktemp("sdxl")
    tok = CLIPTokenizer.from_pretrained(str(write_clip_tokenizer(folder / "tok_src")))
    pipe = diffusers.StableDiffusionXLPipeline(
        vae=make_vae(1, scaling_factor=0.13025),
        text_encoder=make_text_encoder(hidden=12, seed=2),
        text_encoder_2=make_text_encoder(projection_dim=16, hidden=12, act="gelu", seed=4),
        tokenizer=tok,
        tokenizer_2=tok,
        unet=make_unet("sdxl", cross_attention_dim=24, seed=3),
        scheduler=sd_scheduler(),
    )
    pipe.save_pretrained(folder / "pipe")
    return folder / "pipe", pipe


def test_sd_prompt_embeddings_match(sd_folder):
    path, ref = sd_folder
    pipe = load_pipeline(path)
    cond = pipe.encode_prompt(PROMPTS, None, 7.5, 32, 32)
    with torch.no_grad():
        pos, neg = ref.encode_prompt(PROMPTS, "cpu", 1, True, None)
    assert cond.context.shape == (2, 2, 77, 24)
    assert rel_err(cond.context[1], pos.numpy()) <= 1e-4
    assert rel_err(cond.context[0], neg.numpy()) <= 1e-4


@pytest.mark.parametrize(  # each scheduler alone: test_schedulers; the other two: test-slow
    "sampler",
    [s if s == "ddim" else pytest.param(s, marks=pytest.mark.slow) for s in sorted(SCHEDULERS)],
)
def test_sd_final_latent_matches_diffusers(sd_folder, sampler):
    path, ref = sd_folder
    # both sides read the folder's scheduler_config.json (DDIM's, explicit leading spacing)
    ref.scheduler = getattr(diffusers, SCHEDULERS[sampler]).from_pretrained(path / "scheduler")
    pipe = load_pipeline(path)
    rng = np.random.RandomState(0)
    latents = rng.randn(2, 8, 8, 4).astype(np.float32)
    pos, neg = (rng.randn(2, 77, 24).astype(np.float32) for _ in range(2))
    ours = pipe.denoise(Conditioning(jnp.stack([neg, pos])), jnp.asarray(latents), sampler, 10, 7.5)
    with torch.no_grad():
        theirs = ref(
            prompt_embeds=torch.tensor(pos),
            negative_prompt_embeds=torch.tensor(neg),
            latents=nchw(latents),
            num_inference_steps=10,
            guidance_scale=7.5,
            output_type="latent",
        ).images
    err = np.abs(np.asarray(ours) - nhwc(theirs)).max()
    assert err <= 1e-3, f"max abs diff {err:.3g} (latent scale {np.abs(nhwc(theirs)).max():.3g})"


@pytest.mark.slow
def test_sdxl_embeddings_and_final_latent_match_diffusers(sdxl_folder):
    path, ref = sdxl_folder
    pipe = load_pipeline(path)
    assert pipe.is_xl
    cond = pipe.encode_prompt(PROMPTS, None, 5.0, 32, 32)
    with torch.no_grad():
        pos, neg, pooled, neg_pooled = ref.encode_prompt(
            PROMPTS, device="cpu", do_classifier_free_guidance=True
        )
    assert rel_err(cond.context[1], pos.numpy()) <= 1e-4
    assert rel_err(cond.text_embeds[1], pooled.numpy()) <= 1e-4
    assert np.all(np.asarray(cond.context[0]) == 0) and np.all(
        neg.numpy() == 0
    )  # force_zeros_for_empty_prompt
    latents = np.random.RandomState(1).randn(2, 16, 16, 4).astype(np.float32)
    ours = pipe.denoise(cond, jnp.asarray(latents), "ddim", 10, 5.0)
    with torch.no_grad():
        theirs = ref(
            prompt_embeds=pos,
            negative_prompt_embeds=neg,
            pooled_prompt_embeds=pooled,
            negative_pooled_prompt_embeds=neg_pooled,
            latents=nchw(latents),
            height=32,
            width=32,
            num_inference_steps=10,
            guidance_scale=5.0,
            output_type="latent",
        ).images
    assert np.abs(np.asarray(ours) - nhwc(theirs)).max() <= 1e-3


def test_sd_images_match_diffusers_decode(sd_folder):
    """Decode and uint8 post-processing as diffusers does (off by at most one level from rounding)."""
    path, ref = sd_folder
    pipe = load_pipeline(path)
    z = np.random.RandomState(2).randn(2, 8, 8, 4).astype(np.float32)
    ours = pipe.decode(jnp.asarray(z))
    with torch.no_grad():
        img = ref.vae.decode(nchw(z) / ref.vae.config.scaling_factor).sample
    theirs = (np.clip(nhwc(img) / 2 + 0.5, 0, 1) * 255).round().astype(np.uint8)
    assert ours.dtype == np.uint8 and ours.shape == (2, 16, 16, 3)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1
