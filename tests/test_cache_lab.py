"""Step caches in the experiment layer: the `cache` config section and `--cache` of generate,
what a cached run records (the cache, the steps that ran every block, the fraction of block
calls), its quality against uncached `single`, speedups against `single` with and without the
same cache, and bad input."""

import json

import numpy as np
import pytest

from patchpar.lab.cli import main
from patchpar.lab.config import RunConfig
from patchpar.lab.configio import from_dict, point_config, to_dict, with_overrides
from patchpar.lab.runner import run
from patchpar.sampling.cache import FirstBlockCache

STEPS = 6


def dit_config(tmp_path, **overrides) -> RunConfig:
    """The trained fmnist-dit, one prompt, 6 DDIM steps, PSNR against uncached single."""
    base = {
        "experiment": "cache",
        "model": {"name": "fmnist-dit"},
        "sampler": {"name": "ddim", "steps": STEPS, "guidance_scale": 2.0},
        "prompts": {"prompts": ["a photo of a bag"], "seeds": [0]},
        "measure": {"warmup_runs": 0, "repeats": 1, "quality": ["psnr"],
                    "save_images": False},
        "results": str(tmp_path),
    }  # fmt: skip
    return with_overrides(from_dict(RunConfig, base), overrides)


@pytest.mark.slow
def test_cached_runs_record_the_cache_against_uncached_single(tmp_path):
    """A cached `single` and a cached `sync_patch` on 2 devices skip the same steps, record the
    cache, its computed steps and block fraction, and are compared with uncached `single`'s
    images (the cached single run is not taken as the baseline)."""
    cache = {"cache": {"name": "fbcache", "threshold": 0.3}}
    one = run(dit_config(tmp_path, **cache))
    two = run(dit_config(tmp_path, **cache, **{"strategy.name": "sync_patch", "mesh.devices": 2}))
    plain = run(dit_config(tmp_path))
    for r in (one, two):
        m = r["metrics"]
        assert r["status"] == "ok", r.get("error")
        assert r["label"].endswith("+ fbcache threshold=0.3")
        assert m["cache"] == "fbcache(threshold=0.3)"
        n = m["cache_computed_steps"]
        assert 1 <= n < STEPS  # the threshold skips some steps here, never the first
        blocks = 8  # fmnist-dit's transformer blocks
        assert m["blocks_computed"] == pytest.approx((STEPS + n * (blocks - 1)) / (STEPS * blocks))
        # against uncached single: skipped steps change the image
        assert m["latent_max_abs_diff"] > 1e-3 and np.isfinite(m["psnr"])
    # sync_patch with the cache equals single with the cache: the same decisions (each taken
    # far from the threshold, so on any machine), one image
    assert 1e-3 < one["metrics"]["cache_closest_decision"] < float("inf")
    assert two["metrics"]["cache_computed_steps"] == one["metrics"]["cache_computed_steps"]
    assert two["metrics"]["latent_max_abs_diff"] == pytest.approx(
        one["metrics"]["latent_max_abs_diff"], abs=1e-4
    )
    # bytes: a computed step's and a skipped step's, each from a program forced to that
    # branch and equal to its analytic count; a skipped step sends block 0's K/V (1 of the 8
    # blocks) and both kinds all-reduce the decision's two float32 sums (8 bytes on 2 devices)
    m = two["metrics"]
    assert m["analytic_matches_hlo"]
    full, skipped = m["warmup_bytes_per_device"], m["warmup_skipped_step_bytes_per_device"]
    assert skipped - 8 == (full - 8) // 8 > 0
    n = m["cache_computed_steps"]
    assert m["bytes_per_device_per_step"] == pytest.approx(
        (n * full + (STEPS - n) * skipped) / STEPS
    )
    m = plain["metrics"]
    assert m["cache"] == "none" and m["blocks_computed"] == 1.0
    # (its baseline came from the cached single run's pass of the uncached program: another
    # compiled program of the same arithmetic, float rounding apart)
    assert m["cache_computed_steps"] == STEPS and m["latent_max_abs_diff"] <= 1e-5


@pytest.mark.slow
def test_a_predicted_step_is_counted_as_sending_nothing(tmp_path):
    """DistriFusion with TaylorSeer on 2 devices: a computed step's bytes per phase equal the
    uncached run's, a predicted step's are 0, the mean weights them by the steps taken."""
    over = {"strategy": {"name": "distrifusion", "warmup_steps": 1}, "mesh.devices": 2}
    cached = run(dit_config(tmp_path, **over, cache={"name": "taylorseer", "interval": 2,
                                                     "warmup": 1}))  # fmt: skip
    plain = run(dit_config(tmp_path, **over))
    m, p = cached["metrics"], plain["metrics"]
    assert m["analytic_matches_hlo"] and p["analytic_matches_hlo"]
    for phase in ("warmup", "steady"):
        assert m[f"{phase}_bytes_per_device"] == p[f"{phase}_bytes_per_device"] > 0
        assert m[f"{phase}_skipped_step_bytes_per_device"] == 0
    # steps 1 (warm-up phase: 2 steps), 3 and 5 compute; steps 2, 4 and 6 are predicted
    assert m["cache_computed_steps"] == 3
    want = p["warmup_bytes_per_device"] + 2 * p["steady_bytes_per_device"]
    assert m["bytes_per_device_per_step"] == pytest.approx(want / STEPS)


def test_cache_config_bad_input_and_old_records(tmp_path):
    with pytest.raises(ValueError, match=r"^cache: cache='magcache'; known: none, fbcache"):
        dit_config(tmp_path, **{"cache.name": "magcache"}).validate()
    with pytest.raises(ValueError, match=r"^cache: fbcache threshold=-0.1: must be a finite"):
        dit_config(tmp_path, **{"cache.name": "fbcache", "cache.threshold": -0.1}).validate()
    with pytest.raises(ValueError, match=r"cache options \['threshold'\] given without a cache"):
        dit_config(tmp_path, **{"cache.threshold": 0.1}).validate()
    with pytest.raises(ValueError, match=r"cache 'taylorseer' has no option \['threshold'\]"):
        dit_config(tmp_path, **{"cache.name": "taylorseer", "cache.threshold": 0.1}).validate()
    # a cache the model's family lacks: the run's record says so, nothing is generated
    r = run(dit_config(tmp_path, **{"model.name": "fmnist", "cache.name": "fbcache"}))
    assert r["status"] == "error" and "does not exist for a unet denoiser" in r["error"]
    r = run(dit_config(tmp_path, **{"cache.name": "deepcache"}))  # DeepCache on a DiT
    assert r["status"] == "error" and "does not exist for a pixart denoiser" in r["error"]
    # a record from before caches is the same point as one without a cache
    old = to_dict(dit_config(tmp_path))
    del old["cache"]
    assert point_config(old) == point_config(dit_config(tmp_path))


def test_speedups_of_a_cached_run(tmp_path):
    """speedup_vs_single is against uncached single, even when a cached single ran later;
    speedup_vs_single_same_cache against single with the same cache."""
    from patchpar.lab.speedup import speedups

    def record(cfg, seconds):
        return {"config": to_dict(cfg), "status": "ok",
                "metrics": {"denoise_s_median": seconds, "step_s_median": seconds / 10}}  # fmt: skip

    one = {"mesh.processes": 1}
    fb = {"cache": {"name": "fbcache", "threshold": 0.1}}
    rows = [
        record(with_overrides(RunConfig(), one), 4.0),
        record(with_overrides(RunConfig(), {**one, **fb}), 2.0),
        record(with_overrides(RunConfig(), {**one, "cache": {"name": "fbcache"}}), 1.0),
    ]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    two = {"strategy.name": "distrifusion", "mesh.devices": 2, "mesh.processes": 2}
    metrics = {"denoise_s_median": 1.6, "step_s_median": 0.16,
               "layout": {"platform": "cpu", "processes": 2}}  # fmt: skip
    out = speedups(with_overrides(RunConfig(), {**two, **fb}), metrics, tmp_path / "runs.jsonl")
    assert out["speedup_vs_single"] == pytest.approx(2.5)
    assert out["speedup_vs_single_same_cache"] == pytest.approx(1.25)
    # the default threshold given is the same cache as the one left unset
    default = {"cache": {"name": "fbcache", "threshold": 0.05}}
    out = speedups(
        with_overrides(RunConfig(), {**two, **default}), metrics, tmp_path / "runs.jsonl"
    )
    assert out["speedup_vs_single_same_cache"] == pytest.approx(1.0 / 1.6)
    out = speedups(with_overrides(RunConfig(), two), metrics, tmp_path / "runs.jsonl")
    assert out["speedup_vs_single"] == pytest.approx(2.5)
    assert out["speedup_vs_single_same_cache"] is None
    # a cache whose single run is not recorded: null, with the reason
    other = {"cache": {"name": "fbcache", "threshold": 0.4}}
    out = speedups(with_overrides(RunConfig(), {**two, **other}), metrics, tmp_path / "runs.jsonl")
    assert out["speedup_vs_single_same_cache"] is None
    assert "no single run with cache fbcache threshold=0.4" in out["speedup_note"]


def test_generate_with_a_cache(tmp_path, capsys):
    args = ["generate", "--model", "fmnist-dit", "--steps", str(STEPS), "--sampler", "ddim",
            "--cache", "fbcache", "--cache-threshold", "0.3", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    record = json.loads((tmp_path / "generate.json").read_text())
    assert record["cache"] == "fbcache(threshold=0.3)"
    n = record["cache_computed_steps"]
    assert record["blocks_computed"] == pytest.approx(
        FirstBlockCache(0.3).blocks_computed(8, STEPS, n)
    )
    assert f"{n} of {STEPS} steps ran every block" in capsys.readouterr().out
    # TaylorSeer on a UNet: 3 warm-up steps, then one step in 2 computed (steps 1-3 and 5 of 6)
    unet = ["generate", "--model", "fmnist", "--steps", str(STEPS), "--cache", "taylorseer",
            "--cache-interval", "2", "--out", str(tmp_path / "unet")]  # fmt: skip
    assert main(unet) == 0
    record = json.loads((tmp_path / "unet" / "generate.json").read_text())
    assert record["cache"] == "taylorseer(interval=2, warmup=3, order=1, stop=None)"
    assert record["cache_computed_steps"] == 4 and record["blocks_computed"] == pytest.approx(4 / 6)
    assert main([*args[:-2], "--cache-threshold", "0", "--out", str(tmp_path)]) == 2
    assert "fbcache threshold=0.0: must be a finite number > 0" in capsys.readouterr().err


def test_plot_of_quality_against_blocks_computed(tmp_path, capsys):
    """`patchpar plot` draws PSNR against the fraction of blocks computed, one line per strategy
    and cache, the uncached run on each; records without a cache skip it."""
    rows = [("sync_patch", {"name": "none"}, 1.0, float("inf")),
            ("distrifusion", {"name": "none"}, 1.0, 30.0),
            ("distrifusion + fbcache threshold=0.1", {"name": "fbcache", "threshold": 0.1}, 0.6, 25.0),
            ("distrifusion + taylorseer interval=2", {"name": "taylorseer", "interval": 2}, 0.5, 20.0)]  # fmt: skip
    lines = [
        json.dumps(
            {
                "label": label,
                "status": "ok",
                "config": {"cache": cache},
                "metrics": {"blocks_computed": blocks, "psnr": psnr},
            }
        )  # fmt: skip
        for label, cache, blocks, psnr in rows
    ]
    (tmp_path / "runs.jsonl").write_text("\n".join(lines) + "\n")
    import matplotlib

    from patchpar.lab.plots import plot_psnr_vs_blocks
    from patchpar.lab.results import read_records

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    assert plot_psnr_vs_blocks(read_records(tmp_path / "runs.jsonl"), ax)
    drawn = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    assert drawn == {"distrifusion, fbcache": [0.6, 1.0], "distrifusion, taylorseer": [0.5, 1.0]}
    _, ax = plt.subplots()
    assert not plot_psnr_vs_blocks(read_records(tmp_path / "runs.jsonl")[:2], ax)


def test_project_schedules_of_the_caches():
    from patchpar.lab.project import cache_schedule
    from patchpar.sampling.cache import TaylorSeer

    assert cache_schedule(None, 8, None) is None
    ts = TaylorSeer(interval=2, warmup=3)
    assert cache_schedule(ts, 8, None) == [True, True, True, False, True, False, True, False]
    assert cache_schedule(ts, 8, 5) == cache_schedule(ts, 8, None)
    with pytest.raises(ValueError, match=r"cache_computed_steps=4: taylorseer.*computes 5 of 8"):
        cache_schedule(ts, 8, 4)
    fb = FirstBlockCache(0.1)
    assert cache_schedule(fb, 8, 3) == [True, False, True, False, False, True, False, False]
    assert cache_schedule(fb, 8, 8) == [True] * 8
    for bad in (None, 0, 9, 2.5):
        with pytest.raises(ValueError, match=r"cache 'fbcache' decides from the data"):
            cache_schedule(fb, 8, bad)
    with pytest.raises(ValueError, match=r"cache_computed_steps=3: there is no cache"):
        cache_schedule(None, 8, 3)


@pytest.mark.slow
def test_project_a_cached_run(tmp_path):
    """Each kind of step's program is lowered and priced: a first-block cache whose every step
    computes costs the uncached run (plus its decision's all-reduce); TaylorSeer's predicted
    steps cost less, on the parallel plan and on one device."""
    from patchpar.lab.project import ProjectConfig, run_project

    base = dict(model="tiny-dit", resolution=128, strategy="distrifusion", devices=2, steps=8,
                workloads=tmp_path / "w.jsonl")  # fmt: skip
    (full,) = run_project(ProjectConfig.from_flags(**base, cache="fbcache", cache_computed_steps=8))
    assert full["cache_computed_steps"] == 8
    assert full["latency_cached_s"] == pytest.approx(full["latency_s"], rel=1e-2)
    assert full["single_cached_latency_s"] == pytest.approx(full["single_latency_s"], rel=1e-2)
    (ts,) = run_project(ProjectConfig.from_flags(**base, cache="taylorseer", cache_interval=2))
    assert ts["cache"] == "taylorseer(interval=2, warmup=3, order=1, stop=None)"
    assert ts["cache_computed_steps"] == 5
    assert ts["latency_cached_s"] < ts["latency_s"]
    assert ts["single_cached_latency_s"] < ts["single_latency_s"]
    with pytest.raises(ValueError, match=r"cache 'fbcache' decides from the data"):
        run_project(ProjectConfig.from_flags(**base, cache="fbcache"))
