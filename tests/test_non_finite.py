"""NaN and Inf are never a result: a damaged checkpoint is named on load, a run whose latent
goes non-finite fails naming the step (and phase) where it first did, and its record is an
error, never `ok` with PSNR ∞."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from patchpar.lab.cli import main
from patchpar.models import CheckpointError
from patchpar.models.presets import preset_folder
from patchpar.pipelines import load_pipeline
from patchpar.pipelines.checks import NonFiniteError
from patchpar.sampling.loop import run_steps
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler


@pytest.fixture(scope="module")
def nan_dit(tmp_path_factory):
    """fmnist-dit with five NaN in one attention weight."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path_factory.mktemp("nan") / "fmnist-dit"
    shutil.copytree(preset_folder("fmnist-dit"), folder)
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(path))
    state["transformer_blocks.3.attn1.to_q.weight"][0, :5] = np.nan
    save_file(state, str(path), metadata={"format": "pt"})
    return folder


def test_a_nan_weight_is_named_on_load(nan_dit, tmp_path, capsys):
    with pytest.raises(CheckpointError, match=r"'transformer_blocks.3.attn1.to_q.weight' "
                       r"\(96, 96\) holds 5 NaN and 0 Inf value\(s\) of 9216"):  # fmt: skip
        load_pipeline(nan_dit)
    # the command line: bad input (exit 2), one line, and no image written
    out = tmp_path / "out"
    assert main(["generate", "--model", str(nan_dit), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # progress ("loading ..."), then one error
    assert [ln for ln in err if ln.startswith("patchpar: error")] == err[-1:]
    assert "to_q.weight" in err[-1] and "holds 5 NaN" in err[-1]
    assert not list(out.glob("*.png"))


def test_watched_loop_names_the_first_non_finite_step():
    smp = get_sampler("ddim")
    schedule = smp.schedule(SchedulerConfig(), 6)

    def model_fn(x, t, i, state):  # a model that breaks at step index 3
        return jnp.where(i == 3, jnp.nan, 0.0) * jnp.ones_like(x), state

    x = jnp.ones((1, 4, 4, 1))
    *_, first = run_steps(model_fn, smp, schedule, x, smp.init_carry(x), (), 0, 6, watch=True)
    assert int(first) == 3
    *_, first = run_steps(model_fn, smp, schedule, x, smp.init_carry(x), (), 4, 6, watch=True)
    assert int(first) == -1  # no step of [4, 6) broke it


# Euler at guidance 1e30 overflows fmnist-dit's latent in its second step: float32 and
# bfloat16 alike, so the step where it first happened is known.
OVERFLOW = ["--model.name", "fmnist-dit", "--sampler.name", "euler", "--sampler.steps", "4",
            "--sampler.guidance-scale", "1e30", "--measure.repeats", "1"]  # fmt: skip


def test_an_overflowing_run_is_an_error_record_naming_the_step(tmp_path, capsys):
    args = ["run", *OVERFLOW, "--strategy.name", "sync_patch", "--mesh.devices", "2",
            "--experiment", "nan", "--results", str(tmp_path)]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "NaN or Inf in the latent, first after step 2 of 4 (sync_patch on 2 device(s)" in err
    (rec,) = [json.loads(line) for line in (tmp_path / "nan" / "runs.jsonl").open()]
    assert rec["status"] == "error" and "step 2 of 4" in rec["error"]
    assert "psnr" not in rec["metrics"]


@pytest.mark.slow  # the float32 overflow above names its step in the default tier
def test_a_bfloat16_overflow_names_the_steady_phase(tmp_path, capsys):
    out = tmp_path / "gen"
    args = ["generate", "--model", "fmnist-dit", "--sampler", "euler", "--steps", "4",
            "--guidance-scale", "1e30", "--dtype", "bfloat16", "--strategy", "distrifusion",
            "--warmup-steps", "0", "--devices", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "first after step 2 of 4 (steady phase; distrifusion on 2 device(s)" in err
    assert "bfloat16" in err
    assert not out.exists() or not list(out.glob("*.png"))  # no black image left behind


def test_decode_and_metrics_refuse_non_finite_values():
    from patchpar.lab.runner import check_finite_metrics

    pipe = load_pipeline("fmnist-dit")
    latent = np.zeros((1, 32, 32, 1), np.float32)
    latent[0, 3, 4, 0] = np.inf
    with pytest.raises(
        NonFiniteError, match="the latent gave NaN or Inf in 3 of 3072 pixel values"
    ):
        pipe.decode(jnp.asarray(latent))
    check_finite_metrics({"psnr": 30.0, "ssim": None, "fid": 3.0})
    with pytest.raises(NonFiniteError, match=r"fid=nan"):
        check_finite_metrics({"psnr": 30.0, "fid": float("nan")})
