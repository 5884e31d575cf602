"""The Wan text-to-video pipeline against diffusers' WanPipeline on a tiny random folder saved by
diffusers: umT5 embeddings (each prompt's own tokens, zeros beyond), the final latent of a
few-step CFG run with flow UniPC from the same initial latent (<= 1e-3), the decoded frames; the
tiny-wan preset through `patchpar generate`; bad input (frame counts, layouts against devices)."""

import json
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("sentencepiece")

import jax.numpy as jnp  # noqa: E402
from torch_refs import rel_err  # noqa: E402

from patchpar.models.tokenizer import write_t5_tokenizer  # noqa: E402
from patchpar.pipelines import load_pipeline  # noqa: E402

PROMPTS = ["a photo of a red bag", "two  dogs &amp; a cat playing in the snow"]
TEXTS = PROMPTS + ["a cat sitting on a wooden table", "a city street at night, neon lights"]
TOKENS = 40  # umT5 tokens read: more than the prompts have (zeros beyond theirs)
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                   in_channels=4, out_channels=4, text_dim=24, freq_dim=32, ffn_dim=40,
                   num_layers=2, rope_max_seq_len=64)  # fmt: skip
VAE = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
           latents_std=[1.5, 0.8, 1.2, 1.0])  # fmt: skip


def _varied(model, seed):
    """diffusers' init leaves biases and norm scales plain: vary them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("gamma") or ("norm" in name and name.endswith("weight")):
                p.normal_(1, 0.1)
    return model.eval()


# Wan 2.2 TI2V-5B's layout: its residual 16x VAE (2 x 2 pixels per decoder position), a wider
# latent, and timesteps given per token (`expand_timesteps`)
TI2V_VAE = dict(VAE, base_dim=8, decoder_base_dim=12, z_dim=6, is_residual=True, patch_size=2,
                in_channels=12, out_channels=12, scale_factor_spatial=16,
                latents_mean=[0.1, -0.2, 0.05, 0.0, 0.3, -0.1],
                latents_std=[1.5, 0.8, 1.2, 1.0, 0.9, 1.1])  # fmt: skip


def _folder(root, boundary_ratio=None, ti2v=False):
    """A tiny WanPipeline saved by diffusers; with `boundary_ratio`, Wan 2.2's two experts (a
    second transformer of other weights); `ti2v`: the TI2V-5B layout."""
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    umt5 = UMT5EncoderModel(UMT5Config(vocab_size=80, d_model=24, d_kv=6, d_ff=32, num_layers=2,
                                       num_heads=4, feed_forward_proj="gated-gelu",
                                       dropout_rate=0.0)).eval()  # fmt: skip
    z = TI2V_VAE["z_dim"] if ti2v else VAE["z_dim"]
    dit = _varied(
        diffusers.WanTransformer3DModel(**TRANSFORMER | dict(in_channels=z, out_channels=z)), 1
    )
    vae = _varied(diffusers.AutoencoderKLWan(**(TI2V_VAE if ti2v else VAE)), 2)
    tok = AutoTokenizer.from_pretrained(str(write_t5_tokenizer(root / "tok", TEXTS, 80)))
    sched = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction",
                                              use_flow_sigmas=True, flow_shift=3.0)  # fmt: skip
    experts = {}
    if boundary_ratio is not None:
        experts = dict(transformer_2=_varied(diffusers.WanTransformer3DModel(**TRANSFORMER), 3),
                       boundary_ratio=boundary_ratio)  # fmt: skip
    if ti2v:
        experts["expand_timesteps"] = True
    pipe = diffusers.WanPipeline(tokenizer=tok, text_encoder=umt5, transformer=dit, vae=vae,
                                 scheduler=sched, **experts)  # fmt: skip
    pipe.save_pretrained(root / "pipe")
    index = root / "pipe" / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "max_sequence_length": TOKENS}))
    return root / "pipe", pipe


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("wan"))


def test_wan_embeddings_latent_and_frames_match_diffusers(wan_folder):
    path, ref = wan_folder
    pipe = load_pipeline(path)
    assert pipe.family == "wan" and pipe.default_sampler == "unipc"
    negative = ["blurry", "dark  &amp; grey"]
    cond = pipe.encode_prompt(PROMPTS, negative, 5.0, 16, 32)
    with torch.no_grad():
        embeds, neg = ref.encode_prompt(PROMPTS, negative, max_sequence_length=TOKENS)
    assert cond.context.shape == (2, 2, TOKENS, 24)
    assert rel_err(cond.context[1], embeds.numpy()) <= 1e-4
    assert rel_err(cond.context[0], neg.numpy()) <= 1e-4
    # 5 frames of 16 x 32: 2 latent frames of 2 x 4; 4 UniPC steps with its corrector
    latents = np.random.RandomState(1).randn(2, 2, 2, 4, 4).astype(np.float32)  # (B, F, h, w, C)
    out = pipe(PROMPTS, 16, 32, steps=4, guidance_scale=5.0, negative_prompts=negative,
               latents=jnp.asarray(latents), frames=5)  # fmt: skip
    with torch.no_grad():
        theirs = ref(PROMPTS, negative, height=16, width=32, num_frames=5, num_inference_steps=4,
                     guidance_scale=5.0, latents=torch.tensor(latents.transpose(0, 4, 1, 2, 3)),
                     output_type="latent", max_sequence_length=TOKENS).frames.numpy()  # fmt: skip
        video = ref.vae.decode(
            theirs / (1 / torch.tensor(VAE["latents_std"]).view(1, 4, 1, 1, 1))
            + torch.tensor(VAE["latents_mean"]).view(1, 4, 1, 1, 1)
        ).sample.numpy()
    theirs = theirs.transpose(0, 2, 3, 4, 1)
    err = np.abs(out.latents - theirs).max()
    assert err <= 1e-3, f"max abs diff {err:.3g} (latent scale {np.abs(theirs).max():.3g})"
    want = np.round(np.clip(video.transpose(0, 2, 3, 4, 1) / 2 + 0.5, 0, 1) * 255)
    assert out.frames.shape == (2, 5, 16, 32, 3)
    assert np.abs(out.frames.astype(np.float32) - want).max() <= 1  # rounding of near-equal values


def test_wan22_two_experts_match_diffusers(tmp_path):
    """Wan 2.2 A14B's layout: the high-noise transformer while t >= 0.875 x 1000 (2 of 5 steps
    here), then transformer_2 with guidance_scale_2; the UniPC history runs on across the
    switch. Also: the experts' phases on 2 devices under sync_patch equal the one-device run."""
    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy

    path, ref = _folder(tmp_path, boundary_ratio=0.875)
    pipe = load_pipeline(path)
    assert pipe.boundary_ratio == 0.875 and pipe.unet_params_2 is not None
    latents = np.random.RandomState(2).randn(2, 2, 2, 4, 4).astype(np.float32)
    kw = dict(steps=5, guidance_scale=5.0, latents=jnp.asarray(latents), frames=5)
    out = pipe(PROMPTS, 16, 32, guidance_scale_2=3.0, **kw)
    with torch.no_grad():
        theirs = ref(PROMPTS, height=16, width=32, num_frames=5, num_inference_steps=5,
                     guidance_scale=5.0, guidance_scale_2=3.0, output_type="latent",
                     latents=torch.tensor(latents.transpose(0, 4, 1, 2, 3)),
                     max_sequence_length=TOKENS).frames.numpy().transpose(0, 2, 3, 4, 1)  # fmt: skip
    err = np.abs(out.latents - theirs).max()
    assert err <= 1e-3, f"max abs diff {err:.3g} (latent scale {np.abs(theirs).max():.3g})"
    timesteps = np.asarray(ref.scheduler.timesteps)
    which, experts = pipe.experts_at(timesteps, 5.0, 3.0)
    assert which == (0, 1) and experts.starts == (0, 2) and experts.scales == (5.0, 3.0)
    # exact patches: sync_patch over frames on 2 devices, phase by phase, equals the one-device run
    plan, said = Plan(make_strategy("sync_patch"), devices=2), []
    par = pipe(PROMPTS, 16, 32, guidance_scale_2=3.0, plan=plan, log=said.append, **kw)
    assert rel_err(par.latents, out.latents) <= 1e-4
    assert "expert 2 warm-up phase: running steps 3-5 of 5" in " ".join(said)


@pytest.mark.slow  # its VAE's decode parity stays in the default tier (test_wan_models.py)
def test_wan22_ti2v_layout_matches_diffusers(tmp_path):
    """Wan 2.2 TI2V-5B's text-to-video layout: the residual VAE's 16x decode (its shortcut and
    2 x 2 unpatchify) and `expand_timesteps` (every token given the step's timestep: the same
    embedding as one per video, so the denoiser runs unchanged): WanPipeline's latent within
    1e-3, its frames within one grey level."""
    path, ref = _folder(tmp_path, ti2v=True)
    pipe = load_pipeline(path)
    assert pipe.latent_factor == 16 and pipe.latent_channels == 6
    latents = np.random.RandomState(3).randn(1, 2, 2, 4, 6).astype(np.float32)  # 32 x 64 frames
    out = pipe(PROMPTS[:1], 32, 64, steps=3, guidance_scale=5.0, latents=jnp.asarray(latents),
               frames=5)  # fmt: skip
    with torch.no_grad():
        theirs = ref(PROMPTS[:1], height=32, width=64, num_frames=5, num_inference_steps=3,
                     guidance_scale=5.0, latents=torch.tensor(latents.transpose(0, 4, 1, 2, 3)),
                     output_type="np", max_sequence_length=TOKENS).frames  # fmt: skip
        final = ref(PROMPTS[:1], height=32, width=64, num_frames=5, num_inference_steps=3,
                    guidance_scale=5.0, latents=torch.tensor(latents.transpose(0, 4, 1, 2, 3)),
                    output_type="latent", max_sequence_length=TOKENS).frames.numpy()  # fmt: skip
    err = np.abs(out.latents - final.transpose(0, 2, 3, 4, 1)).max()
    assert err <= 1e-3, f"max abs diff {err:.3g}"
    assert out.frames.shape == (1, 5, 32, 64, 3) == np.asarray(theirs).shape
    assert np.abs(out.frames.astype(np.float32) - np.round(np.asarray(theirs) * 255)).max() <= 1


# ---------------------------------------------------------------------------- generate and bad input


@pytest.mark.slow
def test_tiny_wan_generates_a_video_on_frame_and_row_patches(tmp_path):
    """`patchpar generate` on tiny-wan (flow UniPC, CFG): sync_patch on 3 devices over frames, on
    2 over rows and on 3 with patch weights measured give single's latent; each video written
    as a GIF of its frames and a grid."""
    from PIL import Image

    from patchpar.lab.cli import main

    args = ["generate", "--model", "tiny-wan", "--steps", "3", "--frames", "9"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    runs = {"frames": ["--devices", "3", "--layout", "frames"],
            "rows": ["--devices", "2", "--layout", "rows"],
            "measured": ["--devices", "3", "--patch-weights", "measured"]}  # fmt: skip
    for name, flags in runs.items():
        assert main([*args, *flags, "--strategy", "sync_patch", "--out", str(tmp_path / name)]) == 0
    one = np.load(tmp_path / "one" / "latent.npy")
    assert one.shape == (1, 3, 8, 8, 4)  # (B, latent frames, h, w, C)
    for name in runs:
        other = np.load(tmp_path / name / "latent.npy")
        assert np.abs(one - other).max() <= 1e-5 * np.abs(one).max(), name
    record = json.loads((tmp_path / "one" / "generate.json").read_text())
    assert record["frames"] == 9 and record["layout"] == "frames"
    gif = Image.open(tmp_path / "one" / "video_0.gif")
    assert gif.n_frames == 9 and gif.size == (64, 64)
    assert Image.open(tmp_path / "one" / "video_0_frames.png").size == (8 * 64, 2 * 64)


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"sampler.frames": 8}, r"frames=8: .* must be 4k \+ 1; nearest that fit: \[5, 9\]"),
        ({"sampler.frames": 0}, r"frames=0: must be a positive integer of the form 4k \+ 1"),
        (
            {"sampler.frames": 5, "mesh.devices": 4, "strategy.name": "sync_patch"},
            r"layout='frames' over 4 patch devices: the video has 2 latent frame\(s\), fewer",
        ),
        (
            {
                "sampler.frames": 9,
                "mesh.devices": 4,
                "strategy.name": "sync_patch",
                "mesh.layout": "3x2",
            },
            r"3 x 2 = 6 blocks for 4 patch devices; .* \(grids that fit: \['1x4'\]\)",
        ),  # fmt: skip
        (
            {
                "sampler.frames": 9,
                "mesh.devices": 2,
                "strategy.name": "sync_patch",
                "mesh.layout": "2x1",
            },
            r"2 frame blocks x 1 row blocks do not divide the video's 3 latent frames x 4 token "
            r"rows per frame \(grids that fit: \['1x2'\]\)",
        ),  # fmt: skip
        ({"mesh.layout": "diagonal"}, r"layout='diagonal'; known: \['frames', 'rows'\] or FxR"),
        ({"mesh.vae_parallel": "tiles"}, r"vae_parallel='tiles': a video decodes on one device"),
        ({"model.name": "tiny", "sampler.frames": 9}, r"frames=9: tiny makes images, not video"),
        ({"model.name": "tiny", "mesh.layout": "rows"}, r"layout='rows': tiny makes images"),
        ({"sampler.guidance_scale_2": 3.0}, r"guidance_scale_2=3.0: tiny-wan has one denoiser"),
        ({"sampler.guidance_scale_2": -1.0}, r"guidance_scale_2=-1.0: must be a finite number"),
    ],
)
def test_bad_video_input_is_named(flags, message):
    """Every check before any weight is read (the config.json alone)."""
    from patchpar.lab.generate import GenerateConfig, check

    config = GenerateConfig()
    config = replace(config, model=replace(config.model, name="tiny-wan"))
    for key, value in flags.items():
        section, field = key.split(".")
        config = replace(config, **{section: replace(getattr(config, section), **{field: value})})
    with pytest.raises(ValueError, match=message):
        check(config)


def test_calibrate_refuses_a_video_model(capsys):
    """`calibrate` works on images so far (`run` takes a video model: tests/test_video_run.py)."""
    from patchpar.lab.cli import main

    assert main(["calibrate", "--model.name", "tiny-wan"]) == 2
    err = capsys.readouterr().err
    assert "model 'tiny-wan' makes video: `patchpar calibrate` works on images" in err


def test_project_prices_a_video(tmp_path, capsys):
    """`patchpar project` on a video model: the size is the model's frames (64 x 64 x 5 for
    tiny-wan) cut by the layout, the decode the video VAE's (on one device and on row patches);
    DistriFusion's steady phase exposes less than sync_patch's; a width or frame count for an
    image model, and frames the VAE does not take, are named."""
    from patchpar.lab.cli import main
    from patchpar.lab.project import ProjectConfig, run_project
    from patchpar.lab.project_table import format_project

    rows = {}
    for name in ("sync_patch", "distrifusion"):
        config = ProjectConfig.from_flags(model="tiny-wan", strategy=name, devices=2, steps=10,
                                          hardware="h100-sxm", workloads=tmp_path / "w.jsonl")  # fmt: skip
        (rows[name],) = run_project(config)
    r = rows["distrifusion"]
    assert r["resolution"] == "64x64x5" and r["layout"] == "frames" and r["steps"] == 10
    assert r["decode_one_device_s"] > 0 and r["decode_rows_s"] is not None
    assert r["exposed_comm_s"] < rows["sync_patch"]["exposed_comm_s"]
    assert "tiny-wan 64x64 x 5 frames (frames layout)" in format_project([r])
    for flags, message in (
        (["--model", "tiny", "--width", "64"], "width=64: tiny makes square images here"),
        (["--model", "tiny", "--frames", "9"], "frames=9: tiny makes square images here"),
        (["--model", "tiny-wan", "--frames", "8"], "frames=8: the video VAE compresses time 4x"),
    ):
        assert main(["project", *flags]) == 2
        assert message in capsys.readouterr().err


def test_a_latent_of_another_video_is_named():
    pipe = load_pipeline("tiny-wan")
    with pytest.raises(ValueError, match=r"latents of shape \(1, 2, 8, 8, 4\): a video of 9 "
                       r"frames of 64x64 takes \(B, 3, 8, 8, 4\)"):  # fmt: skip
        pipe(["a bag"], steps=1, frames=9, latents=jnp.zeros((1, 2, 8, 8, 4)))


def test_wan22_5b_lowers_with_its_16x_vae_and_bad_experts_are_named(tmp_path):
    """The 5B preset's VAE factors (16x, 4x) size the latent a denoiser lowers on. Two experts: a boundary ratio without a second transformer, or out of
    (0, 1), is refused before any weight is read; a second transformer of another shape, a
    second guidance scale for one denoiser and a step cache across the switch are named."""
    import shutil

    from patchpar.models.loading import CheckpointError
    from patchpar.models.presets import latent_factor, preset_folder, temporal_factor
    from patchpar.models.wan import FAMILY
    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy
    from patchpar.sampling.cache import make_cache

    assert (latent_factor("wan2.2-5b"), temporal_factor("wan2.2-5b")) == (16, 4)
    assert (latent_factor("wan2.1-14b"), temporal_factor("wan2.1-14b")) == (8, 4)
    with pytest.raises(ValueError, match=r"boundary_ratio=0.875 in model_index.json names a swi"):
        FAMILY.check_index({"boundary_ratio": 0.875, "transformer_2": [None, None]})
    with pytest.raises(ValueError, match=r"boundary_ratio=1.5: the fraction"):
        FAMILY.check_index({"boundary_ratio": 1.5, "transformer_2": ["diffusers", "Wan"]})
    assert FAMILY.second_expert({"transformer_2": ["diffusers", "Wan"]}) is None  # as diffusers
    folder = tmp_path / "two"
    shutil.copytree(preset_folder("tiny-wan"), folder)
    with pytest.raises(ValueError, match=r"guidance_scale_2=3.0: .* has one denoiser"):
        load_pipeline(folder)(["a bag"], steps=2, guidance_scale_2=3.0)
    shutil.copytree(folder / "transformer", folder / "transformer_2")
    index = json.loads((folder / "model_index.json").read_text())
    index.update(transformer_2=index["transformer"], boundary_ratio=0.95)
    (folder / "model_index.json").write_text(json.dumps(index))
    pipe = load_pipeline(folder)
    plan = Plan(make_strategy("sync_patch"), 2, cache=make_cache("fbcache"))
    with pytest.raises(ValueError, match=r"cache 'fbcache' with two experts: .* step 2 of 4"):
        pipe(["a bag"], steps=4, plan=plan)
    from patchpar.lab.generate import GenerateConfig, check

    flags = dict(model=str(folder), strategy="sync_patch", devices=2, cache="fbcache", steps=4)
    with pytest.raises(ValueError, match=r"cache 'fbcache' with two experts"):  # before loading
        check(GenerateConfig.from_flags(**flags))
    # the CFG halves on two devices: the first scale decides them, the second may turn it off
    out = pipe(["a bag"], steps=2, plan=Plan(make_strategy("sync_patch"), 2, cfg=2),
               guidance_scale=5.0, guidance_scale_2=1.0)  # fmt: skip
    assert np.isfinite(out.latents).all()
    config = json.loads((folder / "transformer_2" / "config.json").read_text())
    (folder / "transformer_2" / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    with pytest.raises(CheckpointError, match=r"second expert .* differs in num_layers: 2 vs 3"):
        load_pipeline(folder)
