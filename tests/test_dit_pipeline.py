"""The PixArt text-to-image pipeline against diffusers' PixArtAlphaPipeline (same T5 embeddings
and mask, same final latent from the same initial latent, <= 1e-3), PixArt-Σ's 300 tokens, the
tiny-dit preset through `patchpar generate` on row patches, and bad input."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("sentencepiece")

import jax.numpy as jnp  # noqa: E402
from torch_refs import make_vae, nchw, nhwc, rel_err  # noqa: E402

from patchpar.models.loading import CheckpointError  # noqa: E402
from patchpar.models.tokenizer import write_t5_tokenizer  # noqa: E402
from patchpar.pipelines import load_pipeline  # noqa: E402

PROMPTS = ["a photo of a red bag", "two dogs playing in the snow"]
TEXTS = PROMPTS + ["a cat sitting on a wooden table", "a city street at night, neon lights"]
# PixArt-α-like at sample_size 128, where diffusers' pipeline passes the micro-conditions
TRANSFORMER = dict(
    num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=8, num_layers=2,
    cross_attention_dim=24, caption_channels=16, sample_size=128, patch_size=2,
)  # fmt: skip


def _pipeline(cls: str):
    from transformers import AutoTokenizer, T5EncoderModel
    from transformers import T5Config as HFConfig

    torch.manual_seed(0)
    t5 = T5EncoderModel(
        HFConfig(
            vocab_size=80,
            d_model=16,
            d_kv=4,
            d_ff=24,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
        )  # fmt: skip
    ).eval()
    dit = diffusers.PixArtTransformer2DModel(**TRANSFORMER).eval()
    with torch.no_grad():  # diffusers leaves biases and the modulation tables at zero
        for name, p in dit.named_parameters():
            if name.endswith("bias") or "scale_shift_table" in name:
                p.normal_(0, 0.1)
    scheduler = diffusers.DPMSolverMultistepScheduler(
        beta_start=0.0001, beta_end=0.02, beta_schedule="linear", algorithm_type="dpmsolver++"
    )
    return t5, dit, scheduler, AutoTokenizer, getattr(diffusers, cls)


@pytest.fixture(scope="module")
def alpha_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pixart")
    t5, dit, scheduler, auto, cls = _pipeline("PixArtAlphaPipeline")
    tok = auto.from_pretrained(str(write_t5_tokenizer(folder / "tok", TEXTS, vocab_size=80)))
    pipe = cls(
        tokenizer=tok, text_encoder=t5, vae=make_vae(2), transformer=dit, scheduler=scheduler
    )
    pipe.save_pretrained(folder / "pipe")
    return folder / "pipe", pipe


def test_pixart_embeddings_mask_and_final_latent_match_diffusers(alpha_folder):
    path, ref = alpha_folder
    pipe = load_pipeline(path)
    assert pipe.family == "pixart" and pipe.text_tokens == 120
    h, w = 16, 12  # latent; image 128 x 96 (VAE factor 8)
    cond = pipe.encode_prompt(PROMPTS, None, 4.5, 8 * h, 8 * w)
    with torch.no_grad():
        pos, pos_mask, neg, neg_mask = ref.encode_prompt(
            PROMPTS, do_classifier_free_guidance=True, clean_caption=False
        )
    mask = np.asarray(cond.extras["encoder_attention_mask"])
    assert mask.shape == (2, 2, 120) and (mask[1] == pos_mask.numpy()).all()
    assert (mask[0] == neg_mask.numpy()).all()
    assert rel_err(cond.context[1], pos.numpy()) <= 1e-4
    assert rel_err(cond.context[0], neg.numpy()) <= 1e-4
    np.testing.assert_array_equal(cond.extras["resolution"][1], [[128, 96]] * 2)
    np.testing.assert_allclose(cond.extras["aspect_ratio"][0], [[128 / 96]] * 2)
    latents = np.random.RandomState(1).randn(2, h, w, 4).astype(np.float32)
    ours = pipe.denoise(cond, jnp.asarray(latents), "dpmpp_2m", 8, 4.5)
    with torch.no_grad():
        theirs = ref(
            PROMPTS,
            latents=nchw(latents),
            height=8 * h,
            width=8 * w,
            num_inference_steps=8,
            guidance_scale=4.5,
            output_type="latent",
            clean_caption=False,
            use_resolution_binning=False,
        ).images
    err = np.abs(np.asarray(ours) - nhwc(theirs)).max()
    assert err <= 1e-3, f"max abs diff {err:.3g} (latent scale {np.abs(nhwc(theirs)).max():.3g})"


def test_a_sigma_folder_reads_300_tokens(alpha_folder, tmp_path):
    path, _ = alpha_folder
    sigma = tmp_path / "sigma"
    shutil.copytree(path, sigma)
    index = json.loads((sigma / "model_index.json").read_text())
    (sigma / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "PixArtSigmaPipeline"})
    )
    pipe = load_pipeline(sigma)
    assert pipe.text_tokens == 300
    cond = pipe.encode_prompt(PROMPTS[:1], None, 1.0, 128, 128)  # no guidance: one half
    assert cond.context.shape == (1, 1, 300, 16)  # T5 width


def test_bad_dit_folders_are_named(alpha_folder, tmp_path):
    path, _ = alpha_folder
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    for name in ("spiece.model", "tokenizer.json"):  # transformers 5 saves tokenizer.json only
        (broken / "tokenizer" / name).unlink(missing_ok=True)
    with pytest.raises(
        CheckpointError, match="spiece.model .*is missing, and so is tokenizer.json"
    ):
        load_pipeline(broken)
    shutil.rmtree(broken / "tokenizer")
    with pytest.raises(CheckpointError, match="needs tokenizer/"):
        load_pipeline(broken)
    index = json.loads((path / "model_index.json").read_text())
    for name, what in (("QwenImagePipeline", "Qwen-Image"), ("SanaPipeline", "Sana")):
        (broken / "model_index.json").write_text(json.dumps({**index, "_class_name": name}))
        with pytest.raises(CheckpointError, match=f"unsupported: {name} is {what}"):
            load_pipeline(broken)


def test_tiny_dit_generates_on_row_patches(tmp_path):
    """`patchpar generate` on the tiny-dit preset: sync_patch on 2 devices gives single's
    latent (to float32 rounding of its scale); a size that does not fit the patch size is refused with the nearest that do."""
    from patchpar.lab.cli import main

    args = ["generate", "--model", "tiny-dit", "--steps", "3", "--sampler", "dpmpp_2m"]
    args += ["--height", "128", "--width", "96"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert (
        main([*args, "--strategy", "sync_patch", "--devices", "2", "--out", str(tmp_path / "two")])
        == 0
    )
    one, two = (np.load(tmp_path / d / "latent.npy") for d in ("one", "two"))
    assert one.shape == (1, 16, 12, 4)
    # random weights and DDPM's linear betas make a latent of scale ~500 (x0 = eps x sigma /
    # alpha, alpha_T ~ 0.006): float32 rounding is ~1e-7 of it, a seam error of order 1
    assert rel_err(two, one) <= 1e-5, rel_err(two, one)
    pipe = load_pipeline("tiny-dit")
    with pytest.raises(
        ValueError, match=r"height=100 .* multiple of 16 .*patch size 2.*\[96, 112\]"
    ):
        pipe("a bag", height=100, width=96, steps=2)
