"""Bad input gets a clear error (or a warning) naming the value and what would fit: corrupt
checkpoints, configs that do not fit, out-of-range seeds and guidance, over-long prompts,
`generate` defaults, CLI exit codes (issue 12, items 8-13)."""

import json
import shutil
import warnings

import numpy as np
import pytest

from patchpar.lab.cli import main
from patchpar.lab.config import RunConfig
from patchpar.lab.configio import with_overrides
from patchpar.models import CheckpointError, load_unet
from patchpar.models.unet import UNetConfig
from patchpar.pipelines import load_pipeline


@pytest.fixture
def model(micro_folder, tmp_path):
    """A private copy of the micro pipeline folder, to break."""
    dst = tmp_path / "model"
    shutil.copytree(micro_folder, dst)
    return dst


def test_empty_and_corrupt_safetensors_name_the_file(model):
    (weights,) = (model / "unet").glob("*.safetensors")
    weights.write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match=r"diffusion_pytorch_model.safetensors' \(0 bytes\) is not a readable safetensors",
    ):
        load_unet(model / "unet")
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match=r"\(24 bytes\) is not a readable safetensors"):
        load_unet(model / "unet")


def test_extra_checkpoint_keys_are_listed(model):
    from safetensors.numpy import load_file, save_file

    (path,) = (model / "unet").glob("*.safetensors")
    state = load_file(str(path))
    state["down_blocks.7.resnets.0.conv1.weight"] = np.zeros((2, 2), np.float32)
    save_file(state, str(path))
    with pytest.warns(
        UserWarning,
        match=r"1 checkpoint key\(s\) that the model config does not use.*down_blocks\.7\.resnets\.0\.conv1\.weight",
    ):
        load_unet(model / "unet")


def test_unet_config_missing_keys_and_inpainting():
    from torch_refs import MICRO_UNETS

    cfg = dict(MICRO_UNETS["sd"])
    del cfg["block_out_channels"], cfg["up_block_types"]
    with pytest.raises(
        ValueError, match=r"required key\(s\) \['block_out_channels', 'up_block_types'\] missing"
    ):
        UNetConfig.from_diffusers(cfg)
    with pytest.raises(ValueError, match=r"in_channels=9 != out_channels=4: an inpainting"):
        UNetConfig.from_diffusers({**MICRO_UNETS["sd"], "in_channels": 9})


@pytest.mark.parametrize(
    "cls, what",
    [
        ("SanaPipeline", "unsupported: SanaPipeline is Sana"),
        ("QwenImagePipeline", "unsupported: QwenImagePipeline is Qwen-Image"),
        ("WanImageToVideoPipeline", "unsupported: WanImageToVideoPipeline is Wan image-to-video"),
        ("StableDiffusionInpaintPipeline", "is inpainting"),
    ],
)
def test_unsupported_pipeline_class_is_named(model, cls, what):
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": cls}))
    shutil.rmtree(model / "unet")  # a Sana/Qwen-Image folder has no unet/: say what it is instead
    with pytest.raises(CheckpointError, match=what):
        load_pipeline(model)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh.cfg": 0}, r"mesh.cfg=0: must be 1 .* or 2"),
        ({"mesh.devices": 0}, r"mesh.devices=0: must be an integer >= 1"),
        ({"mesh.devices": -2}, r"mesh.devices=-2: must be an integer >= 1"),
        (
            {"prompts.seeds": [0, 2**32]},
            r"prompts.seeds=\(0, 4294967296\): must be integers in \[0, 2\^32\)",
        ),
        ({"prompts.seeds": [-1]}, r"must be integers in \[0, 2\^32\)"),
        (
            {"sampler.guidance_scale": float("nan")},
            r"sampler.guidance_scale=nan: must be a finite number",
        ),
        (
            {"sampler.guidance_scale": float("inf")},
            r"sampler.guidance_scale=inf: must be a finite number",
        ),
        (
            {"sampler.guidance_scale": -3},
            r"sampler.guidance_scale=-3.0: must be a finite number >= 0",
        ),
        (
            {"sampler.guidance_scale": 1.0, "prompts.negative_prompt": "blurry"},
            r"prompts.negative_prompt='blurry': must be empty with sampler.guidance_scale=1.0",
        ),
    ],
)
def test_run_config_rejects(overrides, message):
    with pytest.raises(ValueError, match=message):
        with_overrides(RunConfig(), overrides).validate()


def test_invalid_sweep_point_is_a_row_and_the_sweep_goes_on(tmp_path, micro_folder, capsys):
    from patchpar.lab.results import read_records
    from patchpar.lab.sweep import SweepConfig, run_sweep

    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        f"experiment: bad\nset: {{model.name: '{micro_folder}', results: '{tmp_path}', "
        "sampler.steps: 2, sampler.height: 32, measure.repeats: 1, measure.warmup_runs: 0, "
        "measure.comm: false, measure.quality: [], measure.save_images: false}\n"
        "points:\n  - {mesh.cfg: 0}\n  - {mesh.devices: 1}\n"
    )
    run_sweep(SweepConfig(sweep))
    rows = read_records(tmp_path / "bad" / "runs.jsonl")
    assert [r["status"] for r in rows] == ["error", "ok"]
    assert "invalid config: mesh.cfg=0" in rows[0]["error"]
    # the command prints the table, then exits 1 with one line naming the failed point
    capsys.readouterr()
    assert main(["sweep", str(sweep)]) == 1
    out, err = capsys.readouterr()
    assert "| single |" in out
    errors = [line for line in err.splitlines() if line.startswith("patchpar: error:")]
    assert (
        errors
        == [err.strip().splitlines()[-1]]
        == [
            "patchpar: error: 1 of 2 sweep points did not run (error): single: invalid config: "
            "mesh.cfg=0: must be 1 (both guidance halves on every device) or 2 (split across two "
            "device halves)"
        ]
    )


def test_invalid_yaml_sweep_file(tmp_path, capsys):
    bad = tmp_path / "s.yaml"
    bad.write_text("grid: [unclosed\n")
    assert main(["sweep", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("patchpar: error:") and "s.yaml: not valid YAML" in err


def test_seed_and_guidance_checked_in_the_library(micro_folder):
    pipe = load_pipeline(micro_folder)
    with pytest.raises(ValueError, match=r"seed=4294967296: must be an integer in \[0, 2\^32\)"):
        pipe.initial_latents(1, 32, 32, 2**32)
    with pytest.raises(ValueError, match="guidance_scale=nan: must be a finite number"):
        pipe("a bag", steps=2, guidance_scale=float("nan"))
    with pytest.raises(ValueError, match="guidance_scale=-2: must be a finite number >= 0"):
        pipe("a bag", steps=2, guidance_scale=-2)
    with pytest.raises(ValueError, match="negative prompt with guidance_scale=1.0: guidance <= 1"):
        pipe("a bag", steps=2, guidance_scale=1.0, negative_prompts=["blurry"])


def test_generate_refuses_negative_guidance_and_a_negative_prompt_without_it(
    micro_folder, tmp_path, capsys
):
    base = ["generate", "--model", str(micro_folder), "--steps", "2", "--out", str(tmp_path)]
    assert main(base + ["--guidance-scale", "-2"]) == 2
    assert "guidance_scale=-2.0: must be a finite number >= 0" in capsys.readouterr().err
    assert main(base + ["--guidance-scale", "1", "--negative-prompt", "blurry"]) == 2
    assert "the negative prompt would be dropped" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--strategy", "ulysses", "--ring-degree", "3", "--devices", "4"],
         "ring_degree=3 must divide the patch axis (4 devices)"),
        (["--strategy", "sync_patch", "--devices", "16"], "devices=16 asked for, but only 8"),
        (["--strategy", "distrifusion", "--warmup-steps", "3", "--devices", "2"],
         "warmup_steps=3 must be < steps=2"),
        (["--height", "30"], "height=30 must be a positive multiple of"),
        (["--cache", "teacache"], "cache 'teacache' does not exist for a unet denoiser"),
        (["--strategy", "pipefusion", "--devices", "2"], "splits a stack of identical"),
    ],
)  # fmt: skip
def test_generate_refuses_a_plan_its_model_cannot_run_before_reading_a_weight(
    micro_folder, tmp_path, capsys, monkeypatch, flags, message
):
    """What the model's config.json answers is checked before the pipeline loads (at FLUX.1's
    22 GB, minutes sooner than after loading)."""
    import patchpar.pipelines

    def loaded(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the plan was checked")

    monkeypatch.setattr(patchpar.pipelines, "load_pipeline", loaded)
    base = ["generate", "--model", str(micro_folder), "--steps", "2", "--out", str(tmp_path)]
    assert main(base + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("patchpar: error:") and message in err, err
    assert "AssertionError" not in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_generate_reports_every_problem_at_once(micro_folder, tmp_path, capsys):
    """Three bad flags: three lines, one error each, in one go."""
    flags = ["--seed", "-1", "--timeout-s", "0", "--strategy", "pcpp", "--portion", "2"]
    base = ["generate", "--model", str(micro_folder), "--steps", "2", "--out", str(tmp_path)]
    assert main(base + flags) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.startswith("patchpar: error: ") for line in lines), lines
    assert "seed=-1" in lines[0] and "timeout_s=0.0" in lines[1] and "portion=2.0" in lines[2]


def test_run_reports_every_problem_of_its_config_at_once(micro_folder, tmp_path, capsys):
    args = ["run", "--model.name", str(micro_folder), "--results", str(tmp_path),
            "--sampler.steps", "0", "--mesh.cfg", "3", "--prompts.seeds", "-1",
            "--cache.name", "nocache"]  # fmt: skip
    assert main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert all(line.startswith("patchpar: error: ") for line in lines), lines
    for want in ("mesh.cfg=3", "sampler.steps=0", "prompts.seeds=(-1,)", "cache: "):
        assert sum(want in line for line in lines) == 1, (want, lines)
    assert not list(tmp_path.rglob("*.jsonl"))  # nothing recorded


def test_run_reports_its_configs_and_its_models_problems_together(micro_folder, tmp_path, capsys):
    """A field of the config alone (measure.repeats) and one only the model's config.json
    answers (the height against its VAE factor and row multiple) are said in one batch."""
    args = ["run", "--model.name", str(micro_folder), "--results", str(tmp_path),
            "--sampler.height", "30", "--measure.repeats", "0"]  # fmt: skip
    assert main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("patchpar: error: ")]
    assert len(errors) == 2, lines
    assert "measure.repeats=0" in errors[0] and "height=30 must be a positive multiple" in errors[1]


@pytest.mark.parametrize(
    "args, wants",
    [
        (["comm", "--dtype", "x", "--quant", "zz", "--resolution", "7", "--batch", "-1",
          "--strategy", "bogus"],
         ["dtype='x'", "quant='zz'", "resolution=7", "batch=-1", "unknown strategy 'bogus'"]),
        (["project", "--dtype", "x", "--overlap", "q", "--steps", "0", "--quant", "zz",
          "--hardware", "nope", "--vae-parallel", "tiles", "--cache-computed-steps", "3"],
         ["dtype='x'", "overlap='q'", "steps=0", "model.quant='zz'", "unknown hardware 'nope'",
          "mesh.vae_parallel='tiles'", "cache_computed_steps=3: there is no cache"]),
        (["comm", "--attention", "bogus", "--strategy", "sync_patch", "--devices", "3",
          "--resolution", "64"],
         ["model.attention='bogus'", "latent rows=8 are 2 unit(s) of 4"]),
        (["project", "--resolution", "100", "--strategy", "distrifusion", "--devices", "2",
          "--warmup-steps", "9", "--steps", "5"],
         ["resolution=100: must be a positive multiple of 8", "warmup_steps=9 must be < steps=5"]),
    ],
)  # fmt: skip
def test_comm_and_project_report_every_problem_at_once(args, wants, tmp_path, capsys):
    assert main([*args, "--model", "tiny"]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("patchpar: error:")]
    assert len(errors) == len(wants), errors
    for want, line in zip(wants, errors, strict=True):
        assert want in line, (want, line)


def test_each_problem_is_said_once(micro_folder, tmp_path, capsys):
    """A bad cache is not said again by the plan that builds it, nor scan_blocks' refusal by
    the checks against the model."""
    run = ["run", "--model.name", str(micro_folder), "--results", str(tmp_path),
           "--cache.name", "nocache"]  # fmt: skip
    assert main(run) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    gen = ["generate", "--model", str(micro_folder), "--out", str(tmp_path / "g"),
           "--scan-blocks", "--strategy", "asyncdiff", "--devices", "2"]  # fmt: skip
    assert main(gen) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "scan_blocks with strategy 'asyncdiff'" in err[0], err


def test_dry_run_checks_every_point_and_says_where_it_writes(tmp_path, micro_folder, capsys):
    sweep = tmp_path / "ablation.yaml"
    sweep.write_text(
        f"set: {{model.name: '{micro_folder}', results: '{tmp_path}', sampler.steps: 3, "
        "sampler.height: 32}\n"
        "grid:\n"
        "  - {mesh.devices: [2], sampler.name: [ddim, euler], strategy: [{name: sync_patch}]}\n"
        "  - {mesh.devices: [2], strategy: [{name: pcpp, portion: 2.0}]}\n"
        "  - {mesh.devices: [3], mesh.patch_weights: ['1,1'], strategy: [{name: sync_patch}]}\n"
        "  - {mesh.devices: [2], mesh.processes: [3], strategy: [{name: sync_patch}]}\n"
    )
    assert main(["sweep", str(sweep), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "to run    sync_patch | devices=2 cfg=1"
    assert lines[1] == "to run    sync_patch sampler.name=euler | devices=2 cfg=1"
    assert lines[2].startswith("invalid   pcpp portion=2.0 | devices=2 cfg=1  <- ")
    assert "portion=2.0 must be in (0, 1]" in lines[2]
    assert lines[3].startswith("invalid   sync_patch mesh.patch_weights=1,1 | devices=3")
    assert "2 weight(s) for 3 patch devices" in lines[3]
    assert lines[4].startswith("invalid") and "mesh.processes=3" in lines[4]
    assert lines[5] == f"records -> {tmp_path / 'ablation' / 'runs.jsonl'}"
    assert not (tmp_path / "ablation").exists()  # nothing run, nothing written


def test_long_prompt_warns_what_was_cut(micro_folder):
    pipe = load_pipeline(micro_folder)
    (tok,) = pipe.tokenizers
    long = "a red bag " * 40 + "and the very last words"
    with pytest.warns(
        UserWarning,
        match=r"the text encoder takes 77, so this part was truncated: .*very last words",
    ):
        ids = tok([long])
    assert ids.shape == (1, 77)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok(["a short prompt"])  # no warning


def test_generate_width_follows_height_and_height_zero_is_an_error(tmp_path, micro_folder, capsys):
    out = tmp_path / "gen"
    base = ["generate", "--model", str(micro_folder), "--steps", "2", "--out", str(out)]
    assert main(base + ["--height", "48"]) == 0
    assert json.loads((out / "generate.json").read_text())["latent_shape"] == [1, 24, 24, 4]
    assert main(base + ["--height", "0"]) == 2
    assert "height=0: must be a positive" in capsys.readouterr().err
    assert main(base + ["--seed", str(2**32)]) == 2
    assert "seed=4294967296" in capsys.readouterr().err


def test_generate_default_model_is_the_trained_fmnist_at_its_guidance(tmp_path):
    from patchpar.lab.generate import GenerateConfig

    assert GenerateConfig().model.name == "fmnist"
    out = tmp_path / "gen"
    assert main(["generate", "--steps", "2", "--out", str(out)]) == 0
    record = json.loads((out / "generate.json").read_text())
    assert record["latent_shape"] == [1, 32, 32, 1] and record["guidance_scale"] == 2.0


def test_cli_failures_exit_non_zero_with_one_line(tmp_path, micro_folder, capsys, monkeypatch):
    # a failure that is not bad input: one line, exit 1; --debug shows the traceback
    import patchpar.lab.generate as gen

    def boom(config, log=None, checked=False):
        raise RuntimeError("the accelerator\ncaught fire")

    monkeypatch.setattr(gen, "generate", boom)
    assert main(["generate", "--model", str(micro_folder)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "patchpar: error: RuntimeError: the accelerator caught fire (--debug shows the traceback)"
    ]
    with pytest.raises(RuntimeError, match="caught fire"):
        main(["generate", "--debug", "--model", str(micro_folder)])
    # a record file that is not there: bad input, exit 2, one line
    assert main(["table", str(tmp_path / "nothing")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_unwritable_out_is_an_error_before_any_work(micro_folder, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    args = ["generate", "--model", str(micro_folder), "--steps", "2", "--out", str(blocker / "x")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"patchpar: error: out='{blocker / 'x'}': cannot write there (")
    assert main(["run", "--results", str(blocker), "--strategy.name", "single"]) == 2
    assert "results=" in capsys.readouterr().err


def test_a_program_that_cannot_fit_is_refused_before_it_runs(
    micro_folder, tmp_path, capsys, monkeypatch
):
    """`generate --height 8192` used to fail inside XLA after compiling, seven times over; the
    compiled program's memory is now checked against the device's first (here the device is
    made small, so the micro model's program does not fit)."""
    from patchpar.measure import cost

    monkeypatch.setattr(cost, "device_memory_bytes", lambda device: 1000)
    args = ["generate", "--model", str(micro_folder), "--steps", "2", "--out", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the denoising program needs" in err and "GiB per device" in err
    errors = [ln for ln in err.splitlines() if ln.startswith("patchpar: error")]  # after progress
    assert errors == err.splitlines()[-1:] and not (tmp_path / "latent.npy").exists()
    with pytest.raises(ValueError, match="needs .* more than the 0.00 GiB a device has here"):
        load_pipeline(micro_folder)("a bag", steps=2, check_memory=True)
    # a device that is large enough runs as before
    monkeypatch.setattr(cost, "device_memory_bytes", lambda device: 2**40)
    assert main(args) == 0 and (tmp_path / "latent.npy").exists()
