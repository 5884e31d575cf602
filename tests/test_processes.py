"""Real processes: workers launched by patchpar.lab.launch, joined by jax.distributed (gloo),
one CPU device each. Every launch has a timeout; the tests are skipped only where localhost
cannot be bound."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from mp_worker import WORKER_PROGRAM, can_bind_localhost, quiet
from parallel_helpers import rounding

from patchpar.lab import launch

pytestmark = pytest.mark.skipif(not can_bind_localhost(), reason="localhost cannot be bound")


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _single_latent() -> np.ndarray:
    """The micro UNet's final latent on one device, no strategy at all."""
    from mp_worker import STEPS
    from parallel_helpers import inputs, micro_unet, single_guided

    from patchpar.sampling.loop import run_steps
    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    unet, params = micro_unet("sd")
    x, _, cond = inputs("sd")
    smp = get_sampler("ddim")
    sched = smp.schedule(SchedulerConfig(), STEPS)

    def model_fn(x_in, t, i, state):
        return single_guided(unet, params, x_in, t, cond), state

    x0 = x * sched.init_noise_sigma
    out, _, _ = run_steps(model_fn, smp, sched, x0, smp.init_carry(x0), (), 0, STEPS)
    return np.asarray(out)


def _check(processes: int, cfg: int, names: list[str], tmp_path, also=(), got=None) -> dict:
    """The exact strategies (sync_patch, ring, ulysses, tensor, data parallel) over the processes equal
    the single device (<= 1e-4 relative, the engine's tolerance); a stale strategy equals
    itself on as many fake devices in one process (<= 1e-5). `also`: run in the same launch,
    not checked here. `got`: the latents of a launch already made (else launched here).
    Returns every final latent."""
    from mp_worker import EXACT, final_latents

    if got is None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        out = tmp_path / "latents.npz"
        args = ["denoise", str(out), str(cfg), *names, *also]
        launch.launch(args, processes, timeout_s=400, log=quiet, program=WORKER_PROGRAM)
        got = dict(np.load(out))
    single = _single_latent()
    for name in [n for n in names if n in EXACT]:
        assert _rel(got[name], single) <= 1e-4, name
    stale = [n for n in names if n not in EXACT]
    fake = final_latents(processes, cfg, stale)
    for name in stale:
        assert _rel(got[name], fake[name]) <= 1e-5, name
        # a stale strategy differs from sync_patch, so the comparison above can fail
        assert _rel(got[name], got["sync_patch"]) > 1e-5, name
    return got


# the default tier's two checks share one launch of 2 processes (one start-up, one join)
EXACT_HERE = ["sync_patch"]  # permutes, all-gathers and all-reduces over gloo; FSDP's weight
# gathers, the all-reduce of tensor, all-to-all (ulysses), ring hops and data parallel in the
# slow test below
PACKED = ["distrifusion", "distrifusion_per_site"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(final latents, VAE outputs) of one launch of 2 processes: the strategies above, then
    the VAE's row patches and tiles."""
    tmp = tmp_path_factory.mktemp("launched")
    latents, vae = tmp / "latents.npz", tmp / "vae.npz"
    args = ["denoise_and_vae", str(latents), str(vae), "1", *EXACT_HERE, *PACKED]
    launch.launch(args, 2, timeout_s=400, log=quiet, program=WORKER_PROGRAM)
    return dict(np.load(latents)), dict(np.load(vae))


def test_two_processes_equal_one_device(launched, tmp_path):
    """The exact strategies over 2 gloo processes equal one device; DistriFusion's stale sends
    exchanged together (one group) give the final latent of per-site exchanges (bit for bit
    where XLA compiles the two programs alike; a few ulps apart at most)."""
    got = _check(2, 1, EXACT_HERE, tmp_path, got=launched[0])
    want = got["distrifusion_per_site"]
    assert np.abs(got["distrifusion"] - want).max() <= rounding(want)  # compiled apart
    assert _rel(got["distrifusion"], got["sync_patch"]) > 1e-5


@pytest.mark.slow
def test_vae_rows_and_tiles_over_two_processes_equal_one_device(launched):
    """The VAE's row patches over 2 gloo processes (halo permutes, GroupNorm all-reduces, ring
    hops) decode and encode as one device does; the tiles spread over them decode as on one."""
    from mp_worker import vae_inputs

    from patchpar.parallel.vae import VAEPlan, decode, encode

    got = launched[1]
    vae, params, z, images = vae_inputs()
    mean, logvar = encode(vae, params, images, VAEPlan())
    want = {
        "rows": decode(vae, params, z, VAEPlan()),
        "tiles": decode(vae, params, z, VAEPlan("tiles", 1, tile=64)),
        "mean": mean,
        "logvar": logvar,
    }
    for k, v in want.items():
        assert _rel(got[k], np.asarray(v)) <= 1e-4, k


@pytest.mark.slow
def test_two_processes_stale_strategies_and_four_processes_with_cfg_split(tmp_path):
    _check(2, 1, ["sync_patch", "ring", "ulysses", "tensor", "data", "fsdp"], tmp_path / "exact")
    _check(2, 1, ["sync_patch", "distrifusion"], tmp_path / "distrifusion")
    got = _check(2, 1, ["sync_patch", "pcpp"], tmp_path / "pcpp", also=["pcpp_per_site"])
    assert np.abs(got["pcpp"] - got["pcpp_per_site"]).max() <= rounding(got["pcpp_per_site"])
    _check(4, 2, ["sync_patch", "distrifusion"], tmp_path / "cfg2")


@pytest.mark.slow
def test_a_run_in_two_processes_writes_one_record_with_layout_and_phases(micro_folder, tmp_path):
    cmd = [sys.executable, "-m", "patchpar.lab.cli", "run", "--model.name", str(micro_folder),
           "--strategy.name", "distrifusion", "--strategy.warmup_steps", "1",
           "--mesh.devices", "2", "--processes", "2", "--sampler.steps", "4",
           "--sampler.height", "64", "--measure.repeats", "1", "--measure.warmup-runs", "0",
           "--measure.no-comm", "--measure.quality", "--measure.no-save-images",
           "--experiment", "mp", "--results", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[rank 1]" in res.stderr  # worker output comes back prefixed with its rank
    assert "| distrifusion warmup_steps=1 | 2 |" in res.stdout  # the launcher's summary
    (rec,) = [json.loads(x) for x in (tmp_path / "mp/runs.jsonl").read_text().splitlines()]
    m = rec["metrics"]
    assert rec["status"] == "ok" and rec["config"]["mesh"]["processes"] == 2
    assert m["layout"]["processes"] == 2 and m["layout"]["launched"]
    assert m["layout"]["local_devices"] == 1 and m["layout"]["threads_per_process"] == 1
    assert (m["warmup_phase_steps"], m["steady_steps"]) == (2, 2)
    assert m["warmup_step_s_median"] > 0 and m["steady_step_s_median"] > 0
    assert m["denoise_s_median"] == pytest.approx(
        2 * m["warmup_step_s_median"] + 2 * m["steady_step_s_median"]
    )
    assert m["speedup_vs_single"] is None and "no single run" in m["speedup_note"]


@pytest.mark.slow
def test_processes_run_and_sweep_record_layout_phases_and_speedups(micro_folder, tmp_path):
    """A sweep in launched processes: `single` on one process, sync_patch and distrifusion on
    two; one record per point (process 0 alone writes), speedups against the points before."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        json.dumps(
            {
                "experiment": "mp",
                "set": {
                    "model.name": str(micro_folder),
                    "sampler.steps": 4,
                    "sampler.height": 64,
                    "measure.repeats": 1,
                    "measure.warmup_runs": 0,
                    "measure.save_images": False,
                },
                "grid": [
                    {"strategy": [{"name": "single"}], "mesh.devices": [1]},
                    {
                        "mesh.devices": [2],
                        "strategy": [
                            {"name": "sync_patch"},
                            {"name": "distrifusion", "warmup_steps": 1},
                        ],
                    },
                ],
            }
        )
    )
    res = subprocess.run(
        [sys.executable, "-m", "patchpar.lab.cli", "sweep", str(sweep), "--processes", "2",
         "--results", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[rank 1]" in res.stderr  # worker output comes back prefixed with its rank
    recs = [json.loads(x) for x in (tmp_path / "results/mp/runs.jsonl").read_text().splitlines()]
    assert [r["label"] for r in recs] == ["single", "sync_patch", "distrifusion warmup_steps=1"]
    assert all(r["status"] == "ok" for r in recs)
    single, sync, df = (r["metrics"] for r in recs)
    assert [r["config"]["mesh"]["processes"] for r in recs] == [1, 2, 2]
    assert sync["layout"]["processes"] == 2 and sync["layout"]["launched"]
    assert sync["layout"]["local_devices"] == 1 and sync["layout"]["threads_per_process"] == 1
    assert single["layout"]["processes"] == 1
    assert single["speedup_vs_single"] == 1.0
    assert sync["speedup_vs_single"] == pytest.approx(
        single["denoise_s_median"] / sync["denoise_s_median"]
    )
    assert df["speedup_vs_sync_patch"] == pytest.approx(
        sync["denoise_s_median"] / df["denoise_s_median"]
    )
    assert (df["warmup_phase_steps"], df["steady_steps"]) == (2, 2)
    assert df["steady_step_s_median"] > 0 and sync["steady_step_s_median"] is None
    assert df["bytes_per_device_per_step"] > 0 and "psnr" in df
    assert df["latent_max_abs_diff"] < 1.0 and sync["latent_max_abs_diff"] < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, flags, options",
    [
        ("pipefusion", ["--num-patches", "4"], {"num_patches": 4}),
        ("asyncdiff", ["--warmup-steps", "4"], {"warmup_steps": 4}),
    ],
)
def test_own_programs_in_two_processes_equal_two_fake_devices(tmp_path, strategy, flags, options):
    """The strategies that own their program on the trained fmnist-dit: PipeFusion (stages
    placed per process, hops and the latent's return by collective-permute over gloo) and
    AsyncDiff (a component per process, its output and the prediction passed the same way):
    the latent of 2 launched processes equals that of 2 fake devices in this process."""
    from patchpar.lab.generate import GenerateConfig, generate

    prompts = ("a photo of a sneaker", "a photo of a bag")
    common = ["--model", "fmnist-dit", "--strategy", strategy, "--devices", "2", *flags,
              "--prompt", *prompts]  # fmt: skip
    cmd = [sys.executable, "-m", "patchpar.lab.cli", "generate", *common, "--processes", "2",
           "--out", str(tmp_path / "mp")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    here = GenerateConfig.from_flags(
        model="fmnist-dit",
        prompt=prompts,
        strategy=strategy,
        devices=2,
        out=tmp_path / "here",
        **options,
    )
    generate(here)
    got, want = (np.load(tmp_path / d / "latent.npy") for d in ("mp", "here"))
    assert got.shape == want.shape == (2, 32, 32, 1)
    assert _rel(got, want) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["distrifusion_int2", "compact_sign1"])
def test_compressed_bases_are_bit_identical_across_two_processes(name, tmp_path):
    """Error feedback over gloo: after every step, the base each process holds of the other's
    payload equals the other's own base bit for bit (halos and K/V, stale and fresh)."""
    from test_compress import _assert_bases_identical

    out = tmp_path / "bases.npz"
    launch.launch(["bases", str(out), name], 2, timeout_s=400, log=quiet, program=WORKER_PROGRAM)
    got = dict(np.load(out))
    by_steps: dict = {}
    for key, value in got.items():
        steps, *path = key.split("/")
        node = by_steps.setdefault(int(steps), {})
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    assert sorted(by_steps) == [1, 2, 3, 4]
    for steps, state in by_steps.items():
        assert _assert_bases_identical(state, 2) > 10, steps
