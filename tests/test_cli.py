"""`patchpar generate` end to end on the tiny preset, and the core imports without torch."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from patchpar.lab.cli import main


def test_generate_writes_pngs_and_latent(tmp_path, micro_folder):
    out = tmp_path / "gen"
    args = [
        "generate",
        "--model",
        str(micro_folder),
        "--prompt",
        "a red bag",
        "a blue shoe",
        "--steps",
        "3",
        "--height",
        "32",
        "--width",
        "48",
        "--seed",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    images = [np.asarray(Image.open(out / f"image_{i}.png")) for i in range(2)]
    assert all(img.shape == (32, 48, 3) and img.dtype == np.uint8 for img in images)
    latent = np.load(out / "latent.npy")
    assert latent.shape == (2, 16, 24, 4) and np.isfinite(latent).all()
    record = json.loads((out / "generate.json").read_text())
    assert record["config"]["prompt"] == ["a red bag", "a blue shoe"]
    # which stage took what: each waited for, together within the whole generation's time
    stages = record["stages_s"]
    assert list(stages) == ["encode_s", "compile_s", "denoise_s", "decode_s"]
    assert stages["compile_s"] > 0 and stages["denoise_s"] > 0  # rounded to ms: the rest >= 0
    assert stages["encode_s"] >= 0 and stages["decode_s"] >= 0
    assert sum(stages.values()) <= record["generate_s_including_compile"] + 0.01
    # the same seed gives the same latent
    assert main(args[:-1] + [str(tmp_path / "again")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "again" / "latent.npy"), latent)


def test_bfloat16_run_writes_a_float32_latent(tmp_path, micro_folder):
    out = tmp_path / "bf16"
    args = [
        "generate",
        "--model",
        str(micro_folder),
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "32",
        "--dtype",
        "bfloat16",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    latent = np.load(out / "latent.npy")
    assert latent.dtype == np.float32 and np.isfinite(latent).all()


def test_generate_bad_size_is_a_clear_error(tmp_path, capsys):
    args = ["generate", "--model", "tiny", "--height", "100", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "height=100 must be a positive multiple of 32" in capsys.readouterr().err
    # the default fmnist (pixel space, 2 downsamplings): multiples of 4
    assert main(["generate", "--height", "30", "--out", str(tmp_path)]) == 2
    assert "height=30 must be a positive multiple of 4" in capsys.readouterr().err


def test_core_imports_without_torch():
    from patchpar.models.presets import preset_folder

    preset_folder("tiny")  # written with open-clip's BPE file, which the child cannot see
    code = (
        "import sys\n"
        "for name in ('torch', 'torchvision', 'diffusers', 'open_clip'):\n"
        "    sys.modules[name] = None  # as if not installed: import fails, find_spec gives None\n"
        "import patchpar, patchpar.models, patchpar.sampling.schedulers, patchpar.sampling.loop\n"
        "import patchpar.pipelines, patchpar.lab.cli, patchpar.lab.generate\n"
        "from patchpar.pipelines import load_pipeline\n"
        "out = load_pipeline('tiny')('a cat', height=64, width=64, steps=2)\n"
        "assert sys.modules['torch'] is None, 'torch was imported'\n"
        "print('ok', out.images.shape)\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ok (1, 64, 64, 3)" in res.stdout


def test_the_library_never_imports_the_lab():
    """docs/design.md §1: the lab (patchpar/lab) depends on the library, never the reverse."""
    import ast
    from pathlib import Path

    import patchpar

    root = Path(patchpar.__file__).parent
    offenders = []
    for pkg in ("models", "parallel", "sampling", "pipelines", "measure"):
        for path in (root / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [
                    f"{path.relative_to(root)}: {n}" for n in names if n.startswith("patchpar.lab")
                ]
    assert not offenders


@pytest.mark.parametrize(
    "args, expected",
    [
        (["run", "--sampler.steps", "abc"],
         "--sampler.steps='abc': expected an integer"),
        (["generate", "--height", "x"], "--height='x': expected an integer"),
        (["run", "--sampler.stepz", "3"],
         "Unrecognized options: --sampler.stepz 3 (not options of patchpar run); did you mean "
         "--sampler.steps"),
        (["generate", "--stepz", "3"],  # a short flag, which tyro does not know, suggested
         "--stepz 3 (not options of patchpar generate); did you mean --steps?"),
        (["comm", "--warmup-step", "1"], "did you mean --warmup-steps?"),
        (["sweep"], "Missing from patchpar sweep: PATH"),
        (["bogus"], "Unrecognized options: bogus (Available subcommands: run, sweep"),
    ],
)  # fmt: skip
def test_command_line_errors_are_one_line(args, expected, capsys):
    """tyro's boxes of 9-15 lines become one line naming the option and the value."""
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("patchpar: error: ") and expected in err
