"""The FLUX.1 text-to-image pipeline against diffusers' FluxPipeline on a tiny random folder: the
CLIP pooled and T5 embeddings, the flow-matching Euler schedule with FLUX's resolution-dependent
shift (and schnell's fixed one), the final latent of a few-step run from the same initial latent
(<= 1e-3), the 16-channel-style VAE decode with its shift factor; the tiny-flux preset through
`patchpar generate` on row patches; bad input."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("sentencepiece")

import jax.numpy as jnp  # noqa: E402
from torch_refs import make_text_encoder, rel_err  # noqa: E402

from patchpar.models.tokenizer import write_clip_tokenizer, write_t5_tokenizer  # noqa: E402
from patchpar.pipelines import load_pipeline  # noqa: E402

PROMPTS = ["a photo of a red bag", "two dogs playing in the snow"]
TEXTS = PROMPTS + ["a cat sitting on a wooden table", "a city street at night, neon lights"]
TRANSFORMER = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=24,
    guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)  # fmt: skip
TOKENS = 24  # T5 tokens read


def _vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    vae = AutoencoderKL(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
        layers_per_block=1,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return vae


def _folder(root, guidance_embeds: bool, dynamic: bool):
    from transformers import AutoTokenizer, CLIPTokenizer, T5EncoderModel
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
    dit = diffusers.FluxTransformer2DModel(**{**TRANSFORMER, "guidance_embeds": guidance_embeds})
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0 if dynamic else 1.0, use_dynamic_shifting=dynamic
    )
    clip_tok = CLIPTokenizer.from_pretrained(str(write_clip_tokenizer(root / "clip_src")))
    t5_tok = AutoTokenizer.from_pretrained(
        str(write_t5_tokenizer(root / "t5_src", TEXTS, vocab_size=80))
    )
    pipe = diffusers.FluxPipeline(
        scheduler=scheduler, vae=_vae(), text_encoder=make_text_encoder(hidden=24).eval(),
        tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok, transformer=dit.eval(),
    )  # fmt: skip
    pipe.save_pretrained(root / "pipe")
    index = root / "pipe" / "model_index.json"
    import json

    index.write_text(json.dumps({**json.loads(index.read_text()), "max_sequence_length": TOKENS}))
    return root / "pipe", pipe


@pytest.fixture(scope="module")
def dev_folder(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("flux_dev"), True, True)


def pack(x):  # (B, H, W, C) -> (B, H/2 * W/2, 4C), diffusers' _pack_latents
    b, h, w, c = x.shape
    x = x.transpose(0, 3, 1, 2).reshape(b, c, h // 2, 2, w // 2, 2)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(x, h, w):
    b, _, c4 = x.shape
    x = x.reshape(b, h // 2, w // 2, c4 // 4, 2, 2).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(b, h, w, c4 // 4)


def _run_both(path, ref, guidance, hw=(8, 12), steps=4, negative=None, true_cfg=1.0):
    pipe = load_pipeline(path).with_true_cfg(true_cfg)
    h, w = hw
    cond = pipe.encode_prompt(PROMPTS, negative, guidance, 2 * h, 2 * w)
    latents = np.random.RandomState(1).randn(2, h, w, 4).astype(np.float32)
    ours = pipe.denoise(cond, jnp.asarray(latents), "flow_euler", steps, guidance)
    with torch.no_grad():
        theirs = ref(
            PROMPTS, latents=torch.tensor(pack(latents)), height=2 * h, width=2 * w,
            num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
            max_sequence_length=TOKENS, negative_prompt=negative, true_cfg_scale=true_cfg,
        ).images.numpy()  # fmt: skip
    return pipe, cond, np.asarray(ours), unpack(theirs, h, w)


def test_flux_embeddings_schedule_and_final_latent_match_diffusers(dev_folder):
    path, ref = dev_folder
    pipe, cond, ours, theirs = _run_both(path, ref, 3.5)
    assert (
        pipe.family == "flux"
        and pipe.text_tokens == TOKENS
        and pipe.default_sampler == "flow_euler"
    )
    with torch.no_grad():
        embeds, pooled, _ = ref.encode_prompt(PROMPTS, None, max_sequence_length=TOKENS)
    assert cond.context.shape == (1, 2, TOKENS, 16)
    assert rel_err(cond.context[0], embeds.numpy()) <= 1e-4
    assert rel_err(cond.extras["pooled_projections"][0], pooled.numpy()) <= 1e-4
    np.testing.assert_array_equal(cond.extras["guidance"], [[3.5, 3.5]])
    err = np.abs(ours - theirs).max()
    assert err <= 1e-3, f"max abs diff {err:.3g} (latent scale {np.abs(theirs).max():.3g})"


def test_true_cfg_matches_diffusers(dev_folder):
    """true_cfg_scale > 1 (diffusers' FluxPipeline option): the negative prompt is a second
    guidance half, with dev's guidance input the same in both; the final latent equals
    diffusers' within 1e-3, and differs from the distilled run."""
    path, ref = dev_folder
    negative = ["blurry", "dark"]
    _, cond, ours, theirs = _run_both(path, ref, 3.5, negative=negative, true_cfg=4.0)
    assert cond.context.shape[0] == 2 and cond.extras["guidance"].shape == (2, 2)
    err = np.abs(ours - theirs).max()
    assert err <= 1e-3, f"max abs diff {err:.3g} (latent scale {np.abs(theirs).max():.3g})"
    _, _, plain, _ = _run_both(path, ref, 3.5)
    assert np.abs(ours - plain).max() > 1e-2


def test_true_cfg_is_for_a_distilled_model():
    from types import SimpleNamespace

    from patchpar.pipelines.text2img import Pipeline

    text = SimpleNamespace(loop_scale=lambda g: g)  # a CFG family's conditioning
    pipe = Pipeline(SimpleNamespace(family="unet"), {}, None, None, text, None)
    assert pipe.with_true_cfg(1.0) is pipe
    with pytest.raises(ValueError, match="a unet model guides with guidance_scale"):
        pipe.with_true_cfg(4.0)
    with pytest.raises(ValueError, match=r"true_cfg_scale=-1: must be a finite number >= 0"):
        pipe.with_true_cfg(-1)


def test_flux_schedule_matches_diffusers():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    smp = get_sampler("flow_euler")
    for dynamic, tokens in ((True, 24), (True, 4096), (False, 24)):
        theirs = diffusers.FlowMatchEulerDiscreteScheduler(
            shift=3.0 if dynamic else 1.0, use_dynamic_shifting=dynamic
        )
        sig = np.linspace(1.0, 1 / 7, 7)
        mu = calculate_shift(tokens) if dynamic else None
        theirs.set_timesteps(sigmas=sig, mu=mu)
        config = {**theirs.config, "_class_name": "FlowMatchEulerDiscreteScheduler"}
        cfg = SchedulerConfig.from_diffusers(config).at_tokens(tokens)
        s = smp.schedule(cfg, 7)
        np.testing.assert_allclose(s.sigmas, theirs.sigmas.numpy(), rtol=0, atol=1e-7)
        np.testing.assert_allclose(s.timesteps, theirs.timesteps.numpy() / 1000, rtol=0, atol=1e-7)


def test_flux_vae_decode_shifts_and_scales_like_diffusers(dev_folder):
    path, ref = dev_folder
    pipe = load_pipeline(path)
    z = np.random.RandomState(3).randn(1, 8, 8, 4).astype(np.float32)
    ours = pipe.decode(jnp.asarray(z))
    with torch.no_grad():
        cfg = ref.vae.config
        img = ref.vae.decode(
            torch.tensor(z.transpose(0, 3, 1, 2)) / cfg.scaling_factor + cfg.shift_factor
        ).sample.numpy()
    theirs = np.round(np.clip(img.transpose(0, 2, 3, 1) / 2 + 0.5, 0, 1) * 255)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1


def test_schnell_like_fixed_shift_and_no_guidance_input(tmp_path):
    path, ref = _folder(tmp_path, False, False)
    with pytest.warns(UserWarning, match="has no guidance input"):
        pipe, cond, ours, theirs = _run_both(path, ref, 3.5, hw=(8, 8), steps=2)
    assert "guidance" not in cond.extras
    assert np.abs(ours - theirs).max() <= 1e-3


def test_flux_bad_input(dev_folder):
    path, _ = dev_folder
    pipe = load_pipeline(path)
    with pytest.raises(ValueError, match="takes a negative prompt only with true CFG"):
        pipe.encode_prompt(PROMPTS, ["blurry", "dark"], 3.5, 16, 16)
    with pytest.raises(ValueError, match="sampler 'ddim' needs a DDPM-style model"):
        pipe(PROMPTS[:1], 16, 16, steps=2, guidance_scale=3.5, sampler="ddim")
    with pytest.raises(ValueError, match=r"height=18 must be a positive multiple of 4"):
        pipe(PROMPTS[:1], 18, 16, steps=2, guidance_scale=3.5)
    long = " ".join(TEXTS * 3)  # more T5 tokens than the folder's 24
    with pytest.warns(UserWarning, match="the text encoder takes 24, so this part was truncated"):
        pipe.encode_prompt([long], None, 3.5, 16, 16)


def test_max_sequence_length_is_checked_before_any_weight_is_read(dev_folder, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    """A FLUX folder asking for more T5 tokens than FluxPipeline takes (512): a one-line error
    before a weight is read, not an out-of-memory error after encoding."""
    import shutil

    from patchpar.models import components, loading

    path, _ = dev_folder
    shutil.copytree(path, tmp_path / "pipe")
    index = tmp_path / "pipe" / "model_index.json"
    for bad in (100000, 0, "512"):
        index.write_text(json.dumps({**json.loads(index.read_text()), "max_sequence_length": bad}))
        for module in (loading, components):
            monkeypatch.setattr(module, "read_state_dict", lambda *a: pytest.fail("weights read"))
        with pytest.raises(ValueError, match=rf"max_sequence_length={bad!r} in model_index.json: "
                           r"FluxPipeline reads 1 to 512 T5 tokens \(default 512\)"):  # fmt: skip
            load_pipeline(tmp_path / "pipe")


@pytest.mark.slow
def test_tiny_flux_generates_on_row_patches(tmp_path):
    """`patchpar generate` on the tiny-flux preset (flow_euler and dev's guidance input by
    default): sync_patch on 2 devices gives single's latent; a split that does not fit says so
    in one line."""
    from patchpar.lab.cli import main

    args = ["generate", "--model", "tiny-flux", "--steps", "3"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert (
        main([*args, "--devices", "2", "--strategy", "sync_patch", "--out", str(tmp_path / "two")])
        == 0
    )
    one, two = (np.load(tmp_path / d / "latent.npy") for d in ("one", "two"))
    assert one.shape == (1, 32, 32, 16) and np.abs(one - two).max() <= 1e-5 * np.abs(one).max()
    assert (  # 4-way tensor parallelism of 2 heads: one line naming the degrees that fit
        main([*args, "--devices", "4", "--strategy", "tensor", "--out", str(tmp_path / "t")]) == 2
    )
