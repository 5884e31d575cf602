"""The SD3 text-to-image pipeline against diffusers' StableDiffusion3Pipeline on a tiny random
folder: the three encoders' embeddings (CLIP-L and CLIP-G penultimate states padded to T5's
width, then T5's; both pooled outputs), the flow-matching Euler schedule from the scheduler's own
range with shift 3, the final latent of a few-step CFG run from the same initial latent
(<= 1e-3), with and without T5; the tiny-sd3 preset through `patchpar generate` on row patches;
bad input."""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("sentencepiece")

import jax.numpy as jnp  # noqa: E402
from torch_refs import make_text_encoder, rel_err  # noqa: E402

from patchpar.models.loading import CheckpointError  # noqa: E402
from patchpar.models.tokenizer import write_clip_tokenizer, write_t5_tokenizer  # noqa: E402
from patchpar.pipelines import load_pipeline  # noqa: E402

PROMPTS = ["a photo of a red bag", "two dogs playing in the snow"]
TEXTS = PROMPTS + ["a cat sitting on a wooden table", "a city street at night, neon lights"]
TRANSFORMER = dict(
    sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
    attention_head_dim=8, num_attention_heads=2, joint_attention_dim=48,
    caption_projection_dim=16, pooled_projection_dim=28, pos_embed_max_size=16,
    qk_norm="rms_norm", dual_attention_layers=(0,),
)  # fmt: skip
TOKENS = 20  # T5 tokens read


def _vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    vae = AutoencoderKL(
        block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
        layers_per_block=1, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return vae


def _folder(root):
    from transformers import AutoTokenizer, CLIPTokenizer, T5EncoderModel
    from transformers import T5Config as HFConfig

    torch.manual_seed(0)
    t5 = T5EncoderModel(
        HFConfig(
            vocab_size=80,
            d_model=48,
            d_kv=4,
            d_ff=24,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
        )  # fmt: skip
    ).eval()
    dit = diffusers.SD3Transformer2DModel(**TRANSFORMER)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    clip_tok = CLIPTokenizer.from_pretrained(str(write_clip_tokenizer(root / "clip_src")))
    t5_tok = AutoTokenizer.from_pretrained(
        str(write_t5_tokenizer(root / "t5_src", TEXTS, vocab_size=80))
    )
    pipe = diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_vae(),
        text_encoder=make_text_encoder(projection_dim=12, hidden=16).eval(), tokenizer=clip_tok,
        text_encoder_2=make_text_encoder(projection_dim=16, hidden=24, act="gelu", seed=1).eval(),
        tokenizer_2=clip_tok, text_encoder_3=t5, tokenizer_3=t5_tok, transformer=dit.eval(),
    )  # fmt: skip
    pipe.save_pretrained(root / "pipe")
    index = root / "pipe" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "max_sequence_length": TOKENS}))
    return root / "pipe", pipe


@pytest.fixture(scope="module")
def sd3_folder(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("sd3"))


def _run_both(path, ref, guidance=5.0, hw=(8, 12), steps=3, negative=None):
    pipe = load_pipeline(path)
    h, w = hw
    cond = pipe.encode_prompt(PROMPTS, negative, guidance, 2 * h, 2 * w)
    latents = np.random.RandomState(1).randn(2, h, w, 4).astype(np.float32)
    ours = pipe.denoise(cond, jnp.asarray(latents), "flow_euler", steps, guidance)
    with torch.no_grad():
        theirs = ref(
            PROMPTS, latents=torch.tensor(latents.transpose(0, 3, 1, 2)), height=2 * h,
            width=2 * w, num_inference_steps=steps, guidance_scale=guidance,
            output_type="latent", max_sequence_length=TOKENS, negative_prompt=negative,
        ).images.numpy()  # fmt: skip
    return pipe, cond, np.asarray(ours), theirs.transpose(0, 2, 3, 1)


def test_sd3_embeddings_and_final_latent_match_diffusers(sd3_folder):
    path, ref = sd3_folder
    pipe, cond, ours, theirs = _run_both(path, ref, negative=["blurry", "dark"])
    assert pipe.family == "sd3" and pipe.default_sampler == "flow_euler"
    with torch.no_grad():
        embeds, neg, pooled, neg_pooled = ref.encode_prompt(
            PROMPTS, PROMPTS, PROMPTS, negative_prompt=["blurry", "dark"],
            max_sequence_length=TOKENS,
        )  # fmt: skip
    assert cond.context.shape == (2, 2, 77 + TOKENS, 48)
    for got, want in ((cond.context[1], embeds), (cond.context[0], neg),
                      (cond.extras["pooled_projections"][1], pooled),
                      (cond.extras["pooled_projections"][0], neg_pooled)):  # fmt: skip
        assert rel_err(got, want.numpy()) <= 1e-4
    err = np.abs(ours - theirs).max()
    assert err <= 1e-3, f"max abs diff {err:.3g} (latent scale {np.abs(theirs).max():.3g})"


def test_sd3_without_t5_matches_diffusers(sd3_folder, tmp_path):
    """diffusers allows dropping T5 (text_encoder_3=None: its tokens are zeros); a folder
    without text_encoder_3/ runs so, with a warning, to diffusers' latent."""
    path, ref = sd3_folder
    shutil.copytree(path, tmp_path / "pipe")
    for sub in ("text_encoder_3", "tokenizer_3"):
        shutil.rmtree(tmp_path / "pipe" / sub)
    index = tmp_path / "pipe" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "text_encoder_3": [None, None],
                                 "tokenizer_3": [None, None]}))  # fmt: skip
    ref3 = diffusers.StableDiffusion3Pipeline(**{**ref.components, "text_encoder_3": None,
                                                 "tokenizer_3": None})  # fmt: skip
    with pytest.warns(UserWarning, match=r"no text_encoder_3/ \(T5\): the pipeline runs without"):
        _, cond, ours, theirs = _run_both(tmp_path / "pipe", ref3, hw=(8, 8), steps=2)
    assert np.all(np.asarray(cond.context)[:, :, 77:] == 0)
    assert np.abs(ours - theirs).max() <= 1e-3


def test_sd3_schedule_matches_diffusers():
    """No sigmas passed (StableDiffusion3Pipeline): the scheduler's own range, shifted."""
    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    for shift, n in ((3.0, 7), (1.0, 4), (3.0, 28)):
        theirs = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
        theirs.set_timesteps(n)
        config = {**theirs.config, "_class_name": "FlowMatchEulerDiscreteScheduler"}
        cfg = SchedulerConfig.from_diffusers(config)
        s = get_sampler("flow_euler").schedule(
            SchedulerConfig(**{**cfg.__dict__, "flow_sigmas": "scheduler"}), n
        )
        np.testing.assert_allclose(s.sigmas, theirs.sigmas.numpy(), rtol=0, atol=1e-7)
        np.testing.assert_allclose(s.timesteps, theirs.timesteps.numpy() / 1000, rtol=0, atol=1e-7)


@pytest.mark.parametrize("sub, what", [("text_encoder", "CLIP-L"), ("tokenizer_2", "CLIP-G")])
def test_a_missing_clip_encoder_is_named(sd3_folder, tmp_path, sub, what):
    path, _ = sd3_folder
    shutil.copytree(path, tmp_path / "pipe")
    shutil.rmtree(tmp_path / "pipe" / sub)
    with pytest.raises(CheckpointError, match=rf"needs {sub}/ \({what}\); it is missing") as e:
        load_pipeline(tmp_path / "pipe")
    assert "only T5 (text_encoder_3/) may be left out" in str(e.value)


def test_max_sequence_length_above_the_models_is_refused(sd3_folder, tmp_path):
    path, _ = sd3_folder
    shutil.copytree(path, tmp_path / "pipe")
    index = tmp_path / "pipe" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "max_sequence_length": 600}))
    with pytest.raises(ValueError, match=r"max_sequence_length=600 in model_index.json: "
                       r"StableDiffusion3Pipeline reads 1 to 512 T5 tokens \(default 256\)"):  # fmt: skip
        load_pipeline(tmp_path / "pipe")


@pytest.mark.slow
def test_tiny_sd3_generates_on_row_patches(tmp_path):
    """`patchpar generate` on the tiny-sd3 preset (flow_euler, CFG): sync_patch on 2 devices
    gives single's latent."""
    from patchpar.lab.cli import main

    args = ["generate", "--model", "tiny-sd3", "--steps", "3"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert (
        main([*args, "--devices", "2", "--strategy", "sync_patch", "--out", str(tmp_path / "two")])
        == 0
    )
    one, two = (np.load(tmp_path / d / "latent.npy") for d in ("one", "two"))
    assert one.shape == (1, 32, 32, 16) and np.abs(one - two).max() <= 1e-5 * np.abs(one).max()
