"""The experiment layer's reading side, on hand-written records (no model runs): where sweeps
write, labels that tell points apart in tables and plots, key checks, non-record files, and
records of every shape as one DataFrame (`patchpar.lab.load_records`)."""

import json

import pytest
import yaml

from patchpar.lab import load_records
from patchpar.lab.cli import main
from patchpar.lab.config import RunConfig
from patchpar.lab.sweep import load_sweep
from patchpar.lab.tables import markdown, point_labels, read_runs, varying_keys


def run_record(label="sync_patch", devices=8, status="ok", run_id="r", **config) -> dict:
    """A runner-shaped record: config sections as dicts, metrics, status, provenance."""
    cfg = {"mesh": {"devices": devices, "data": 1, "fsdp": False}, "sampler": {"name": "ddim"}}
    for dotted, value in config.items():
        section, key = dotted.split("__")
        cfg.setdefault(section, {})[key] = value
    cfg["strategy"] = {"name": label.split()[0]}
    return {
        "run_id": run_id,
        "label": label,
        "status": status,
        "config": cfg,
        "metrics": {"bytes_per_device_per_step": 2**20 * devices, "psnr": 30.0},
        "provenance": {"git_commit": "abc", "git_dirty": False},
    }


def write(folder, records, name="runs.jsonl"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_runs_go_to_the_working_folder_and_sweeps_to_their_own_experiment(tmp_path):
    assert str(RunConfig().results) == "runs"  # the published records are under results/
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"experiment": "published"}))
    sweep = tmp_path / "my_ablation.yaml"
    sweep.write_text(yaml.safe_dump({"base": "base.yaml", "grid": {"sampler.steps": [4, 6]}}))
    points = load_sweep(sweep)
    assert {p.experiment for p in points} == {"my_ablation"}  # never the base config's folder
    assert {str(p.results) for p in points} == {"runs"}
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump({"experiment": "mine", "base": "base.yaml"}))
    assert load_sweep(named)[0].experiment == "mine"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty sweep file"):
        load_sweep(empty)


def test_labels_name_the_fields_that_tell_points_apart():
    plain = run_record(run_id="a")
    data = run_record(run_id="b", mesh__data=2)
    fsdp = run_record(run_id="c", mesh__fsdp=True)
    labels = point_labels([plain, data, fsdp])
    assert labels == ["sync_patch", "sync_patch mesh.data=2", "sync_patch mesh.fsdp=true"]
    # every field that differs is named, a sampler's steps beside its name too
    ddim = [run_record(f"distrifusion w={w}", run_id=f"d{w}") for w in (0, 1)]
    dpm = [
        run_record(f"distrifusion w={w}", run_id=f"p{w}", sampler__name="dpmpp_2m",
                   sampler__steps=25)
        for w in (0, 1)
    ]  # fmt: skip
    for r in ddim:
        r["config"]["sampler"]["steps"] = 20
    assert varying_keys(ddim + dpm) == ["sampler.name", "sampler.steps"]
    assert point_labels(ddim + dpm)[2] == "distrifusion w=0 sampler.name=dpmpp_2m sampler.steps=25"
    assert len(set(point_labels(ddim + dpm))) == 4
    # a field shown as a column of its own is left out of the label
    assert point_labels([plain, data], shown=("mesh.data",)) == ["sync_patch", "sync_patch"]


def test_labels_never_hide_a_difference_behind_a_column(tmp_path):
    """Two folders whose points differ in their steps and in a column (devices): the label
    still names the steps, in the table and in the plots' series, which are labelled over
    every record given before a figure picks the ones it draws."""
    from patchpar.lab.plots import _named, plot_bytes_vs_devices, style

    a = write(tmp_path / "a", [run_record("distrifusion", run_id="a", mesh__devices=2,
                                          sampler__steps=10)])  # fmt: skip
    b = write(tmp_path / "b", [run_record("distrifusion", run_id="b", mesh__devices=4,
                                          sampler__steps=20)])  # fmt: skip
    records = read_runs([a, b])
    text = markdown(records, ("label", "mesh.devices"))
    # 20 steps is the default: not spelled out; 10 is
    assert "| distrifusion sampler.steps=10 | " in text and "| distrifusion | " in text
    names = [r["_name"] for r in _named(records, ("mesh.devices",))]
    assert len(set(names)) == 2  # two series, not one line through both points
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    for r in records:
        r["metrics"]["bytes_per_device_per_step"] = 1.0
    assert plot_bytes_vs_devices(records, ax) and len(ax.get_lines()) == 2
    plt.close(fig)
    # long values that share a head and a tail still get labels of their own
    seeds = [run_record(run_id=f"s{n}", prompts__seeds=list(range(n))) for n in (10, 50, 90)]
    seeds[2]["config"]["prompts"]["seeds"] = [*range(40), *range(100, 150)]  # same ends as 50's
    seeds[2]["config"]["prompts"]["seeds"][-10:] = list(range(40, 50))
    assert len(set(point_labels(seeds))) == 3
    # a field older records lack is filled in as it ran, not named as a difference
    old = run_record(run_id="o")
    new = run_record(run_id="n", measure__compute_only=False)
    assert point_labels([old, new]) == ["sync_patch", "sync_patch"]
    # many series: a colour and marker pair of their own each
    pairs = {tuple(style(i).values()) for i in range(40)}
    assert len(pairs) == 40


def test_labels_say_each_difference_once_and_no_default(tmp_path):
    """Two folders: a FLUX run with true classifier-free guidance and a negative prompt, and a
    w8 run of another model at the defaults. Each label names what tells its run apart, once
    (`+ w8` is the quant mode: no `model.quant=w8` after it), never a default value and never
    an empty one."""
    true_cfg = run_record("single", run_id="t", devices=1, model__name="fmnist-flux",
                          sampler__true_cfg_scale=4.0,
                          prompts__negative_prompt="blurry")  # fmt: skip
    w8 = run_record("single + w8", run_id="w", devices=1, model__name="tiny-flux",
                    model__quant="w8", sampler__true_cfg_scale=1.0,
                    prompts__negative_prompt="")  # fmt: skip
    records = read_runs([write(tmp_path / "a", [true_cfg]), write(tmp_path / "b", [w8])])
    labels = point_labels(records, ("mesh.devices",))
    assert labels == [
        "single sampler.true_cfg_scale=4.0 prompts.negative_prompt=blurry",
        "single + w8 model.name=tiny-flux",
    ]
    text = markdown(records, ("label", "mesh.devices"))
    assert "model.quant" not in text and "true_cfg_scale=1.0" not in text
    assert not any(t.endswith("=") for lab in labels for t in lab.split())
    # a value with spaces, or an empty one where that is not the default, is quoted
    spaced = run_record("single", run_id="s", prompts__negative_prompt="low quality")
    empty = run_record("single", run_id="e", measure__ground_truth="")
    assert point_labels([run_record("single"), spaced, empty])[1:] == [
        'single prompts.negative_prompt="low quality"',
        'single measure.ground_truth=""',
    ]
    # records whose label does not name their cache (no label): the cache is named after it
    bare = [run_record("single", run_id=c, cache__name=c) for c in ("none", "fbcache")]
    for r in bare:
        del r["label"]
    assert point_labels(bare) == ["single", "single cache.name=fbcache"]
    # neither holds the default (7.5): the most common value is the reference
    guided = [run_record(run_id=str(g), sampler__guidance_scale=g) for g in (2.0, 2.0, 4.0)]
    assert point_labels(guided) == [
        "sync_patch",
        "sync_patch",
        "sync_patch sampler.guidance_scale=4.0",
    ]


def test_table_tells_points_and_folders_apart(tmp_path):
    mine = write(tmp_path / "runs" / "x", [run_record(run_id="m")])
    published = write(tmp_path / "results" / "x", [run_record(run_id="p"), run_record(
        run_id="q", mesh__data=2)])  # fmt: skip
    records = read_runs([mine, published])
    text = markdown(records, ("label", "mesh.devices", "psnr"))
    assert text.splitlines()[0] == "| strategy | records | devices | PSNR dB |"
    rows = [ln for ln in text.splitlines()[2:]]
    assert len(rows) == 3 and len(set(rows)) == 3
    assert any(str(mine) in ln for ln in rows) and any("mesh.data=2" in ln for ln in rows)


def test_table_refuses_unknown_keys_and_files_that_hold_no_runs(tmp_path, capsys):
    folder = write(tmp_path / "x", [run_record()])
    assert main(["table", str(folder), "--columns", "label", "steady_ms"]) == 2
    err = capsys.readouterr().err
    assert "--columns 'steady_ms': no record has this key" in err and err.count("\n") == 1
    assert main(["table", str(folder), "--sort-by", "mesh.device"]) == 2
    err = capsys.readouterr().err
    assert "--sort-by 'mesh.device'" in err and "did you mean" in err and "mesh.devices" in err
    assert main(["table", str(folder), "--group-by", "nothing.here"]) == 2
    capsys.readouterr()
    sweep = tmp_path / "s.yaml"
    sweep.write_text("grid: {}\n")
    assert main(["table", str(sweep)]) == 2
    assert "is not a records file" in capsys.readouterr().err
    other = write(tmp_path / "bench", [{"kind": "all-gather", "seconds": 1.0}], "collectives.jsonl")
    assert main(["table", str(other / "collectives.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "holds no run records" in err and "warning" not in err
    assert main(["table", str(folder), "--columns", "label", "mesh.devices", "psnr"]) == 0


def test_load_records_reads_every_shape_into_one_frame(tmp_path):
    runs = write(
        tmp_path / "sweep",
        [run_record(run_id="a"), run_record(run_id="b", status="error"), run_record(run_id="c")],
    )
    bench = write(
        tmp_path / "bench_unet",
        [{"config": "sdxl", "git_commit": "def", "git_dirty": True, "patchpar_s": 1.5}],
        "records.jsonl",
    )
    write(
        tmp_path / "bench_unet",
        [{"kind": "all-gather", "operand_bytes": 8, "seconds": 0.001, "provenance": {"git_commit": "g"}}],
        "collectives.jsonl",
    )  # fmt: skip
    df = load_records(runs, bench)
    assert list(df["kind"]) == ["run"] * 3 + ["bench_unet.collectives", "bench_unet"]
    assert list(df["provenance.git_commit"]) == ["abc"] * 3 + ["g", "def"]
    assert df.loc[df["kind"] == "bench_unet", "config.name"].item() == "sdxl"
    assert df.loc[df["kind"] == "bench_unet.collectives", "collective"].item() == "all-gather"
    assert df["metrics.psnr"].tolist()[:3] == [30.0] * 3
    assert {"source", "config.mesh.devices", "label"} <= set(df.columns)
    # the newest record of each point, and ok rows only
    assert list(load_records(runs, latest=True)["run_id"]) == ["c"]
    assert list(load_records(runs, ok_only=True)["run_id"]) == ["a", "c"]
    # point_label: the label `patchpar table` prints, over the run records of every file
    other = write(tmp_path / "other", [run_record(run_id="d", sampler__steps=50)])
    labels = load_records(runs, other, latest=True)["point_label"].tolist()
    assert labels == ["sync_patch", "sync_patch sampler.steps=50"]
    with pytest.raises(ValueError, match="no records at"):
        load_records(tmp_path / "nothing")
    (tmp_path / "notes.md").write_text("# not records\n")
    with pytest.raises(ValueError, match="not a record file"):
        load_records(tmp_path / "notes.md")
    with pytest.raises(ValueError, match="name at least one"):
        load_records()


def test_plots_draw_one_series_per_point(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from patchpar.lab.plots import plot_bytes_vs_devices

    records = [
        run_record(run_id="a", devices=2),
        run_record(run_id="b", devices=8),
        run_record(run_id="c", devices=8, mesh__data=2),
        run_record(run_id="d", devices=8, mesh__fsdp=True),
    ]
    fig, ax = plt.subplots()
    assert plot_bytes_vs_devices(records, ax)
    legend = sorted(t.get_text() for t in ax.get_legend().get_texts())
    assert legend == ["sync_patch", "sync_patch mesh.data=2", "sync_patch mesh.fsdp=true"]
    plt.close(fig)
