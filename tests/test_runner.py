"""The experiment runner: configs (YAML round-trip, dotted overrides, errors), `patchpar run`
records, a sweep killed mid-way and resumed, tables, plots and the notebook."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from patchpar.lab.cli import main
from patchpar.lab.config import RunConfig
from patchpar.lab.configio import dump_config, from_dict, load_config, to_dict, with_overrides
from patchpar.lab.results import read_records
from patchpar.lab.sweep import SweepConfig, load_sweep, run_sweep
from patchpar.lab.tables import DEFAULT_COLUMNS, get, markdown, read_runs, summary_columns

REPO = Path(__file__).resolve().parent.parent


def micro_base(micro_folder, results) -> dict:
    """A RunConfig (as YAML data) on the micro model: 32x32 images, 3 steps, quick to compile."""
    return {
        "experiment": "micro",
        "model": {"name": str(micro_folder)},
        "sampler": {"steps": 3, "height": 32, "width": 32, "guidance_scale": 5.0},
        "prompts": {"prompts": ["a red bag"], "seeds": [0, 1]},
        "measure": {"warmup_runs": 0, "repeats": 2},
        "results": str(results),
    }


# ---------------------------------------------------------------------------- configs


def test_config_round_trips_through_yaml(tmp_path):
    cfg = with_overrides(
        RunConfig(),
        {
            "experiment": "x",
            "mesh.devices": 4,
            "mesh.cfg": 2,
            "strategy": {"name": "pcpp", "portion": 0.5, "send": "band"},
            "sampler.steps": 7,
            "sampler.dtype": "bfloat16",
            "prompts.prompts": ["a", "b"],
            "prompts.seeds": [3, 4],
            "measure.quality": ["psnr"],
        },
    )
    assert cfg.strategy.portion == 0.5 and cfg.prompts.seeds == (3, 4)
    assert cfg.strategy.warmup_steps is None  # a replaced sub-config keeps its defaults
    dump_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert from_dict(RunConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg
    cfg.validate()
    with pytest.raises(AttributeError):
        cfg.mesh.devices = 2  # frozen


def test_every_shipped_config_and_sweep_loads_and_validates():
    configs = sorted((REPO / "experiments" / "configs").glob("*.yaml"))
    sweeps = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))
    assert configs and {p.stem for p in sweeps} >= {
        "quickstart",
        "devices_strategy",
        "warmup",
        "groupnorm",
        "pcpp_portion",
    }
    for p in configs:
        load_config(p).validate()
    for p in sweeps:
        points = load_sweep(p)
        assert len(set(points)) == len(points), f"{p.name} repeats a point"
        for cfg in points:
            cfg.validate()
    portions = {
        c.strategy.portion for c in load_sweep(REPO / "experiments/sweeps/pcpp_portion.yaml")
    }
    assert portions == {round(0.1 * k, 1) for k in range(1, 11)}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"strategy.portio": 0.5}, "unknown key 'strategy.portio'"),
        ({"strateg.portion": 0.5}, "unknown key 'strateg'"),
        ({"mesh.devices": "four"}, "mesh.devices='four': expected int"),
        ({"prompts.seeds": [0, "x"]}, "prompts.seeds='x': expected int"),
        ({"strategy": {"name": "pcpp", "portoin": 0.3}}, "unknown key 'strategy.portoin'"),
    ],
)
def test_bad_override_names_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with_overrides(RunConfig(), overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"strategy.name": "pcp"}, "strategy.name='pcp': must be one of"),
        ({"sampler.dtype": "float16"}, "sampler.dtype='float16'"),
        ({"measure.quality": ["psnr", "fidd"]}, "measure.quality"),
        ({"strategy": {"name": "pcpp", "portion": 1.5}}, "portion"),
        ({"strategy": {"name": "naive_patch", "portion": 0.3}}, "has no option"),
        (
            {"strategy": {"name": "distrifusion", "warmup_steps": 20}},
            "warmup_steps=20 must be < steps=20",
        ),
        ({"mesh.devices": 2}, "strategy 'single' runs on 1 device"),
        ({"measure.quality": ["clip_score"]}, "model 'tiny' has no default CLIP"),
        ({"measure.quality": ["fid"], "prompts.seeds": [0]}, "at least 2 images in all"),
        ({"mesh.vae_parallel": "ring"}, "mesh.vae_parallel='ring'; known: .'off', 'rows'"),
        ({"mesh.vae_tile": -8}, "vae_tile=-8: must be 0"),
        ({"model.quant": "int4"}, "model.quant='int4': int4 activations are not offered"),
        ({"model.quant": "q8"}, "model.quant='q8': unknown; modes: none, w8"),
    ],
)
def test_bad_value_is_an_error_naming_it(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        with_overrides(RunConfig(), overrides).validate()


def test_quality_inputs_are_checked_before_generating(tmp_path, monkeypatch):
    """prompt_accuracy on a model without a classifier, a prompt naming no class, a CLIP that
    does not load: errors before any image is made."""
    from patchpar.lab import runner
    from patchpar.lab.evaluate import check_quality_inputs

    def no_generating(*a, **k):
        raise AssertionError("generated before checking the quality inputs")

    monkeypatch.setattr(runner, "timed_denoise", no_generating)
    tiny = with_overrides(
        RunConfig(), {"measure.quality": ["prompt_accuracy"], "results": str(tmp_path)}
    )
    rec = runner.run(tiny, log=lambda _: None)
    assert rec["status"] == "error" and "has no classifier" in rec["error"]
    fm = {"model.name": "fmnist", "sampler.height": 32, "sampler.width": 32}
    odd = with_overrides(
        RunConfig(), {**fm, "measure.quality": ["prompt_accuracy"], "prompts.prompts": ["a cat"]}
    )
    with pytest.raises(ValueError, match="'a cat' names no Fashion-MNIST class"):
        check_quality_inputs(odd)
    gone = with_overrides(
        RunConfig(), {**fm, "measure.quality": ["clip_score"], "measure.clip_model": str(tmp_path)}
    )
    with pytest.raises(Exception, match="open_clip"):  # a folder without a CLIP in it
        check_quality_inputs(gone)


def test_a_bare_yaml_off_is_named_as_a_boolean(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("mesh: {vae_parallel: off}\n")
    assert main(["run", str(path)]) == 2
    assert "mesh.vae_parallel=False: expected str (in YAML a bare off" in capsys.readouterr().err


def test_cli_overrides_apply_on_top_of_the_yaml(tmp_path, capsys):
    from patchpar.lab.cli import _run_config

    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump({"strategy": {"name": "pcpp", "send": "band"}, "mesh": {"devices": 8}})
    )
    cfg = _run_config([str(path), "--strategy.portion", "0.5", "--sampler.steps", "9"])
    assert (cfg.strategy.name, cfg.strategy.send, cfg.strategy.portion) == ("pcpp", "band", 0.5)
    assert (cfg.mesh.devices, cfg.sampler.steps) == (8, 9)
    # a misspelt flag: tyro's error names it and suggests the right one, exit status 2
    with pytest.raises(SystemExit) as e:
        main(["run", str(path), "--strategy.portio", "0.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--strategy.portio" in err and "--strategy.portion" in err
    # a value the config rejects: one line naming it, exit status 2, no record written
    assert main(["run", str(path), "--strategy.portion", "1.5", "--results", str(tmp_path)]) == 2
    assert "portion=1.5" in capsys.readouterr().err
    assert not list(tmp_path.rglob("runs.jsonl"))
    # a YAML with an unknown key
    path.write_text("strategy: {name: pcpp, portoin: 0.3}\n")
    assert main(["run", str(path)]) == 2
    assert "unknown key 'strategy.portoin'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- a sweep, killed and resumed


SWEEP_GRID = [
    # two patch weights for three patch devices: a failed point, first (the killed child's one
    # record: written by the checks before any work)
    {"strategy": [{"name": "sync_patch"}], "mesh.devices": [3], "mesh.patch_weights": ["1,1"]},
    {"strategy": [{"name": "single"}], "mesh.devices": [1]},
    {
        "mesh.devices": [2],
        "mesh.vae_parallel": ["rows"],  # the decode on row patches too (exact)
        "strategy": [
            {"name": "pcpp", "portion": 0.3, "warmup_steps": 1},
            {"name": "pcpp", "portion": 1.0, "warmup_steps": 1},
        ],
    },
    # data parallel: the two images on two devices, one each
    {"strategy": [{"name": "sync_patch"}], "mesh.devices": [2], "mesh.data": [2]},
]


@pytest.fixture(scope="module")
def swept(tmp_path_factory, micro_folder):
    """A sweep started in a child process, killed once its first record is written, then run
    again to the end. Returns (sweep file, results folder, first record)."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "base.yaml").write_text(yaml.safe_dump(micro_base(micro_folder, root / "results")))
    sweep = root / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "base.yaml", "grid": SWEEP_GRID}))
    # no `experiment:` in the sweep file: its records go to a folder named after the file, not
    # to the base config's (`micro`, which could hold other records)
    runs = root / "results" / "sweep" / "runs.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-m", "patchpar.lab.cli", "sweep", str(sweep)],
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not read_records(runs) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    first = read_records(runs)
    assert len(first) == 1, f"expected the child to be killed after one record, found {len(first)}"
    run_sweep(SweepConfig(sweep))
    assert not (root / "results" / "micro").exists()
    return sweep, root / "results" / "sweep", first[0]


def test_killed_sweep_resumes_with_every_point_once(swept):
    sweep, folder, first = swept
    records = read_records(folder / "runs.jsonl")
    points = load_sweep(sweep)
    assert len(records) == len(points) == 5
    from patchpar.lab.runner import point_key

    assert sorted(point_key(r["config"]) for r in records) == sorted(point_key(p) for p in points)
    assert records[0] == first  # the row written before the kill is kept as it was
    assert [r["status"] for r in records].count("ok") == 4
    failed = [r for r in records if r["status"] != "ok"]
    assert (
        failed[0]["status"] == "error" and "2 weight(s) for 3 patch devices" in failed[0]["error"]
    )
    # a third run finds nothing to do
    run_sweep(SweepConfig(sweep))
    assert read_records(folder / "runs.jsonl") == records
    # --retry-failed runs the failed point again (a new row), nothing else
    run_sweep(SweepConfig(sweep, retry_failed=True))
    again = read_records(folder / "runs.jsonl")
    assert len(again) == 6 and again[-1]["config"] == failed[0]["config"]


def test_record_schema(swept):
    _, folder, _ = swept
    records = read_records(folder / "runs.jsonl")
    by = {r["label"]: r for r in records if r["status"] == "ok"}
    for r in records:
        assert {"run_id", "time", "experiment", "label", "strategy", "config", "status", "error",
                "metrics", "images", "provenance", "baseline"} <= set(r)  # fmt: skip
        assert r["experiment"] == "sweep"  # the sweep file's name
        prov = r["provenance"]
        assert {"git_commit", "versions", "device_kind", "platform", "device_count"} <= set(prov)
        assert isinstance(from_dict(RunConfig, r["config"]), RunConfig)  # the full config
    m = by["pcpp warmup_steps=1 portion=1.0"]["metrics"]
    for k in ("compile_s", "denoise_s_median", "step_s_median", "bytes_per_device_per_step",
              "steady_bytes_per_device", "warmup_bytes_per_device", "flops_per_device_per_step",
              "psnr", "ssim", "stale_bytes_per_device"):  # fmt: skip
        assert isinstance(m[k], float | int), k
    assert m["denoise_s_min"] <= m["denoise_s_median"] <= m["denoise_s_max"]
    assert len(m["denoise_s_all"]) == 2 and m["analytic_matches_hlo"] is True
    assert m["step_s_median"] == pytest.approx(m["denoise_s_median"] / 3)
    # bytes per step: 2 exact steps (warmup_steps=1) then 1 stale step
    assert m["bytes_per_device_per_step"] == pytest.approx(
        (2 * m["warmup_bytes_per_device"] + m["steady_bytes_per_device"]) / 3
    )
    assert by["pcpp warmup_steps=1 portion=1.0"]["strategy"]["send"] == "full"  # default filled in
    # text encoding, denoising and decode timed apart, the decode as the point placed it
    for r in by.values():
        t = r["metrics"]
        for k in ("encode_s", "decode_s"):
            assert 0 < t[f"{k}_min"] <= t[f"{k}_median"] <= t[f"{k}_max"], k
        assert t["end_to_end_s_median"] == pytest.approx(
            t["encode_s_median"] + t["denoise_s_median"] + t["decode_s_median"]
        )
    assert m["vae_parallel"] == "rows" and by["single"]["metrics"]["vae_parallel"] == "off"
    # the phases timed apart: 2 warm-up steps, 1 stale step, adding up to the whole
    assert (m["warmup_phase_steps"], m["steady_steps"]) == (2, 1)
    assert m["denoise_s_median"] == pytest.approx(
        2 * m["warmup_step_s_median"] + m["steady_step_s_median"]
    )
    # fake devices in one process: no speedup, and the record says why
    assert m["speedup_vs_single"] is None and "fake CPU devices" in m["speedup_note"]
    assert m["layout"]["processes"] == 1 and not m["layout"]["launched"]
    # the kernel and dtype `auto` resolved to, and the compiled programs' memory per device
    assert (m["attention"], m["compute_dtype"]) == ("chunked", "float32")
    mem = m["memory_per_device"]
    assert set(mem) == {"warmup", "steady"} and mem["steady"]["aliased"] >= 0
    assert m["memory_per_device_bytes"] == max(v["total"] for v in mem.values()) > 0
    # the mesh and the weights each device holds
    assert m["mesh_degrees"] == {"data": 1, "cfg": 1, "patch": 2, "model": 1}
    assert m["weight_bytes_per_device"] > 0
    # data parallel: the images split over the data axis, each what single makes of it
    dp = by["sync_patch"]["metrics"]
    assert dp["mesh_degrees"] == {"data": 2, "cfg": 1, "patch": 1, "model": 1}
    assert dp["latent_max_abs_diff"] <= 1e-4 and dp["bytes_per_device_per_step"] == 0
    # single is its own baseline; a stale strategy differs from it
    single, stale = by["single"]["metrics"], by["pcpp warmup_steps=1 portion=0.3"]["metrics"]
    assert single["identical"] and single["psnr"] is None and single["ssim"] == pytest.approx(1.0)
    assert not stale["identical"] and 0 < stale["psnr"] < 200 and stale["ssim"] < 1
    # one baseline for every point, images on disk next to the records
    assert len({r["baseline"] for r in records}) == 1
    for r in by.values():
        assert len(r["images"]) == 2 and all((folder / p).is_file() for p in r["images"])


def test_table_groups_and_sorts(swept, tmp_path):
    _, folder, _ = swept
    records = read_runs([folder])
    assert len(records) == 5  # the latest of each point (the failed one was run twice)
    text = markdown(records, sort_by=("mesh.devices", "label"))
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and "strategy" not in ln]
    assert [ln.split(" | ")[0].strip("| ") for ln in lines] == [
        "single",
        # every config field that differs among the records is named where not the common one
        "pcpp warmup_steps=1 portion=0.3 mesh.vae_parallel=rows",
        "pcpp warmup_steps=1 portion=1.0 mesh.vae_parallel=rows",
        "sync_patch mesh.data=2",  # data parallel, 2 devices: told apart from the one below
        "sync_patch mesh.patch_weights=1,1",  # 3 devices (failed)
    ]
    assert "∞ (identical)" in lines[0] and "(error)" in text
    grouped = markdown(
        records, columns=("label", "psnr"), sort_by=("label",), group_by="mesh.devices"
    )
    assert [ln for ln in grouped.splitlines() if ln.startswith("###")] == [
        "### mesh.devices = 1",
        "### mesh.devices = 2",
        "### mesh.devices = 3",
    ]
    out = tmp_path / "t.md"
    assert main(["table", str(folder), "--columns", "label", "psnr", "--out", str(out)]) == 0
    assert out.read_text().startswith("| strategy | PSNR dB |")
    # a short key finds the strategy with its defaults filled in (the config holds only those set)
    assert {get(r, "strategy.portion") for r in records if r["label"].startswith("pcpp")} == {
        0.3,
        1.0,
    }
    pcpp = next(r for r in records if r["label"] == "pcpp warmup_steps=1 portion=0.3")
    assert get(pcpp, "strategy.gn") == "corrected"  # pcpp's default, filled in
    # the summary printed by run/sweep adds the data degree where some record split images
    data_at = DEFAULT_COLUMNS.index("mesh.cfg") + 1
    with_data = DEFAULT_COLUMNS[:data_at] + ("mesh.data",) + DEFAULT_COLUMNS[data_at:]
    assert summary_columns(records) == with_data
    no_data = [r for r in records if r["config"]["mesh"].get("data", 1) == 1]
    assert summary_columns(no_data) == DEFAULT_COLUMNS
    # ... and a quality column only where some record has it
    ok = next(r for r in records if r["status"] == "ok")
    measured = [{**ok, "metrics": {**ok["metrics"], "prompt_accuracy": 0.5}}]
    assert summary_columns(records + measured)[-2:] == ("prompt_accuracy", "status")
    # some images identical to single (the mean PSNR is infinite): the cell says how many
    partly = {**ok, "metrics": {**ok["metrics"], "psnr": None}}
    partly["metrics"].update(identical=False, psnr_identical_images=9, quality_samples=10)
    assert "| ∞ (9/10 identical) |" in markdown([partly], columns=("label", "psnr"))
    # today's records: the mean over the images that differ, and the count beside it
    partly["metrics"]["psnr"] = 48.0
    assert "| 48.00 (9/10 identical) |" in markdown([partly], columns=("label", "psnr"))


def test_plots_from_records(swept, tmp_path):
    _, folder, _ = swept
    out = tmp_path / "plots"
    assert main(["plot", str(folder), "--out", str(out), "--prompt-grid"]) == 0
    assert len(list(out.glob("prompt_grid_*.png"))) == 4  # one per ok run
    from PIL import Image

    for name in (
        "bytes_vs_devices",
        "psnr_vs_devices",
        "step_time_vs_strategy",
        "psnr_vs_portion",
        "grid",
    ):
        img = Image.open(out / f"{name}.png")
        assert img.size[0] > 200 and img.size[1] > 100, name


def test_plot_skips_what_the_records_lack(tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    runs.write_text(
        json.dumps({"label": "x", "status": "error", "config": {}, "metrics": {}}) + "\n"
    )
    assert main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped") == 7
    assert main(["table", str(tmp_path / "nothing")]) == 2
    assert "no records at" in capsys.readouterr().err


@pytest.mark.slow
def test_notebook_executes(swept, monkeypatch, run_notebook):
    _, folder, _ = swept
    monkeypatch.setenv("PATCHPAR_RESULTS", str(folder))
    text, images = run_notebook(REPO / "experiments" / "notebooks" / "records.ipynb")
    assert "5 records (4 ok)" in text
    assert len(images) >= 2


def test_records_from_before_new_config_fields_are_the_same_point():
    """A record written before a config field existed (here the data axis, FSDP and the context
    and tensor degrees) is the point the new default config names, so sweeps skip it."""
    from patchpar.lab.config import RunConfig
    from patchpar.lab.configio import to_dict
    from patchpar.lab.runner import point_key

    old = to_dict(RunConfig())
    del old["mesh"]["data"], old["mesh"]["fsdp"]
    for key in ("ring_degree", "ulysses_degree", "tp_degree"):
        del old["strategy"][key]
    assert point_key(old) == point_key(RunConfig())


def test_run_counts_the_programs_it_timed(swept, micro_folder):
    """A run's bytes and FLOPs come from its timed phase programs (the loop body is one step),
    not from a second lowering: they equal `measure`'s one-step programs of the same plan."""
    from patchpar.lab.config import build_plan
    from patchpar.measure.cost import measure
    from patchpar.pipelines import load_pipeline

    _, folder, _ = swept
    rec = next(
        r for r in read_records(folder / "runs.jsonl")
        if r["label"] == "pcpp warmup_steps=1 portion=1.0" and r["status"] == "ok"
    )  # fmt: skip
    m = rec["metrics"]
    pipe = load_pipeline(micro_folder)
    plan = build_plan("pcpp", {"warmup_steps": 1, "portion": 1.0}, 2, 1)
    f = pipe.latent_factor
    ref = measure(pipe.unet, plan, (32 // f, 32 // f), batch=2, guidance_scale=5.0)
    wu, st = ref["phases"]["warmup"], ref["phases"]["steady"]
    assert m["warmup_bytes_per_device"] == wu["hlo"]["all"]["max"] > 0
    assert m["steady_bytes_per_device"] == st["hlo"]["all"]["max"] > 0
    # one step of the loop: the UNet call and guidance, plus the sampler's few elementwise ops
    assert st["flops_per_device"] <= m["flops_per_device_per_step"] <= 1.01 * st["flops_per_device"]


@pytest.mark.parametrize(
    "name",
    [
        "distrifusion",
        pytest.param("pipefusion", marks=pytest.mark.slow),
        pytest.param("asyncdiff", marks=pytest.mark.slow),
    ],  # fmt: skip
)
def test_a_runs_phases_compile_at_once_and_chain(name):
    """`compile_phases` compiles a stale run's phases together, the later one lowered on the
    earlier one's output shapes: the compiler places them as the earlier phase leaves them, so
    nothing is compiled again (its inputs then would carry placements), and the phases chain to
    the latent of the run in one piece."""
    import jax
    import numpy as np

    from patchpar.lab.generation import get_pipeline
    from patchpar.lab.phases import compile_phases
    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy

    pipe = get_pipeline("fmnist-dit", "auto")
    options = {"warmup_steps": 2} if name != "pipefusion" else {}
    plan = Plan(make_strategy(name, **options), 2)
    cond = pipe.encode_prompt(["a bag"], None, 2.0, 32, 32)
    x0 = pipe.initial_latents(1, 32, 32, 0)
    programs, args = pipe.denoise_phases(cond, x0, "ddim", 4, 2.0, plan)
    compiled, _, entering = compile_phases(programs, args)
    assert [p for p, _, _ in compiled] == ["warmup", "steady"]
    placed = [getattr(a, "sharding", None) for a in jax.tree.leaves(entering["steady"])]
    assert placed and all(s is None for s in placed), "the steady phase was compiled again"
    x, loop = args[3], None
    for _, _, c in compiled:
        x, loop = c(*args[:3], x, loop)
    whole = pipe.denoise(cond, x0, "ddim", 4, 2.0, plan)
    assert np.abs(np.asarray(x) - np.asarray(whole)).max() <= 1e-5
