"""`patchpar generate` under every strategy, and every validation error of the engine."""

import json

import numpy as np
import pytest

from patchpar.lab.cli import main
from patchpar.lab.generate import GenerateConfig, generate
from patchpar.parallel.engine import Plan
from patchpar.parallel.strategies import make_strategy

SLOW = pytest.mark.slow  # test_sync_patch_cli_latent_equals_single runs sync_patch too
STRATEGIES = [
    pytest.param("single", [], 1, 1, marks=SLOW),
    pytest.param("naive_patch", ["--split", "alternate"], 4, 1, marks=SLOW),
    pytest.param("sync_patch", [], 8, 1, marks=SLOW),
    pytest.param("distrifusion", ["--warmup-steps", "1", "--gn", "stale"], 4, 2, marks=SLOW),
    ("pcpp", ["--portion", "0.3", "--send", "band", "--warmup-steps", "1"], 8, 1),
]


@pytest.mark.parametrize("strategy, flags, devices, cfg", STRATEGIES)
def test_generate_runs_for_every_strategy(micro_folder, tmp_path, strategy, flags, devices, cfg):
    out = tmp_path / strategy
    args = [
        "generate",
        "--model",
        str(micro_folder),
        "--strategy",
        strategy,
        "--devices",
        str(devices),
        "--cfg",
        str(cfg),
        "--steps",
        "3",
        "--seed",
        "0",
        "--prompt",
        "a cat",
        "--height",
        "32",
        "--width",
        "32",
        "--out",
        str(out),
        *flags,
    ]
    assert main(args) == 0
    record = json.loads((out / "generate.json").read_text())
    assert record["strategy"].startswith(strategy) and record["devices"] == devices
    assert (out / "image_0.png").is_file()
    latent = np.load(out / "latent.npy")
    assert latent.shape == (1, 16, 16, 4) and np.isfinite(latent).all()
    stateful = strategy in ("distrifusion", "pcpp")
    assert (record["stale_bytes_per_device"] > 0) == stateful


def test_sync_patch_cli_latent_equals_single(micro_folder, tmp_path):
    base = dict(model=str(micro_folder), prompt=("a cat",), steps=3, height=32, width=32)
    generate(GenerateConfig.from_flags(**base, out=tmp_path / "a"))
    generate(
        GenerateConfig.from_flags(
            **base, out=tmp_path / "b", strategy="sync_patch", devices=4, cfg=2
        )
    )
    a, b = np.load(tmp_path / "a" / "latent.npy"), np.load(tmp_path / "b" / "latent.npy")
    assert np.abs(a - b).max() <= 1e-4


@pytest.mark.parametrize(
    "config, message",
    [
        (
            dict(strategy="naive_patch", devices=8, height=48, width=32, fsdp=True),
            r"uneven patches \(4, 4, 4, 4, 2, 2, 2, 2 latent rows\) with strategy 'naive_patch'",
        ),
        (
            dict(strategy="naive_patch", split="col", devices=4, height=32, width=40),
            r"latent columns=20 with split='col': column patches split evenly",
        ),
        (dict(strategy="sync_patch", devices=4, cfg=3), r"cfg=3: must be 1 .* or 2"),
        (dict(strategy="sync_patch", devices=3, cfg=2), r"devices=3 is not divisible by cfg=2"),
        (dict(strategy="sync_patch", devices=16), r"devices=16 asked for, but only 8 present"),
        (dict(strategy="pcpp", devices=2, portion=0.0), r"portion=0.0 must be in \(0, 1\]"),
        (dict(strategy="pcpp", devices=2, portion=1.5), r"portion=1.5 must be in \(0, 1\]"),
        (
            dict(strategy="distrifusion", devices=2, warmup_steps=3, steps=3),
            r"warmup_steps=3 must be < steps=3 .* use warmup_steps <= 2",
        ),
        (dict(strategy="pcpp", devices=2, send="half"), r"send='half'; known: \['full', 'band'\]"),
        (
            dict(strategy="distrifusion", devices=2, gn="batch"),
            r"gn='batch'; known: \['separate', 'stale', 'corrected', 'sync'\]",
        ),
        (
            dict(strategy="distrifusion", devices=2, gn="sync", no_sync=True),
            r"no_sync=True exchanges nothing after warm-up, so GroupNorm is local",
        ),
        (
            dict(strategy="distrifusion", devices=2, no_sync=True),
            r"it needs gn='separate', got gn='corrected'",
        ),
        (
            dict(strategy="naive_patch", devices=2, split="diagonal"),
            r"split='diagonal'; known: \['row', 'col', 'alternate'\]",
        ),
        (
            dict(strategy="sync_patch", devices=2, portion=0.3),
            r"strategy 'sync_patch' has no option\(s\) \['portion'\]; its options: \['wire'\]",
        ),
        (
            dict(strategy="distrifusion", devices=2, portion=0.3),
            r"no option\(s\) \['portion'\]; its options: \['warmup_steps', 'gn', 'comm_groups', 'codec', 'residual', 'extrapolate', 'text', 'no_sync'\]",
        ),
        (
            dict(strategy="megatron"),
            r"unknown strategy 'megatron'; known: \['single', 'naive_patch', 'sync_patch', "
            r"'distrifusion', 'pcpp', 'compact', 'ring', 'ulysses', 'tensor', 'pipefusion', "
            r"'asyncdiff'\]",
        ),
        (
            dict(strategy="sync_patch", devices=8, data=3),
            r"devices=8 is not divisible by data=3 x "
            r"cfg=1 = 3: .* data can be one of \[1, 2, 4, 8\]",
        ),
        (
            dict(strategy="sync_patch", devices=4, data=2, prompt=("a", "b", "c")),
            r"batch of 3 image\(s\) per call is not divisible by data=2.* data in \[1, 3\]",
        ),
        (
            dict(strategy="single", devices=2, data=2),
            r"strategy 'single' runs on 1 device, got "
            r"devices=2 \(data=2, cfg=1\)",
        ),
        (
            dict(strategy="ring", devices=8, ring_degree=3),
            r"ring: ring_degree=3 must divide the "
            r"patch axis \(8 devices\); divisors: \[1, 2, 4, 8\]",
        ),
        (
            dict(strategy="ulysses", devices=8, cfg=2, ring_degree=2, ulysses_degree=4),
            r"ring_degree=2 x ulysses_degree=4 = 8, but the patch axis has 4 devices",
        ),
        (
            dict(strategy="tensor", devices=8, tp_degree=3),
            r"tensor: tp_degree=3 must divide the 8 devices an image has .* one of \[1, 2, 4, 8\]",
        ),
        (
            dict(strategy="sync_patch", devices=2, ring_degree=2),
            r"strategy 'sync_patch' has no option\(s\) \['ring_degree'\]",
        ),
        (dict(strategy="single", devices=2), r"strategy 'single' runs on 1 device"),
        (
            dict(strategy="sync_patch", devices=4, cfg=2, guidance_scale=1.0),
            r"cfg=2 .* guidance_scale=1.0 turns guidance off",
        ),
    ],
)
def test_validation_errors_name_the_numbers(micro_folder, tmp_path, config, message):
    base = dict(
        model=str(micro_folder),
        prompt=("a cat",),
        steps=config.pop("steps", 5),
        height=32,
        width=32,
    )
    with pytest.raises(ValueError, match=message):
        generate(GenerateConfig.from_flags(**{**base, **config, "out": tmp_path}))
    assert not (tmp_path / "latent.npy").exists()


def test_cli_reports_validation_error_without_traceback(micro_folder, tmp_path, capsys):
    args = [
        "generate",
        "--model",
        str(micro_folder),
        "--strategy",
        "pcpp",
        "--devices",
        "2",
        "--portion",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 2
    assert "portion=2.0 must be in (0, 1]" in capsys.readouterr().err


def test_plan_validation_is_independent_of_pipeline():
    from parallel_helpers import micro_unet

    unet, _ = micro_unet("sd")
    with pytest.raises(ValueError, match=r"latent rows=8 are 4 unit\(s\) of 2 .* fewer than the 8"):
        Plan(make_strategy("sync_patch"), 8).validate(unet, (8, 16), 10, 5.0)
