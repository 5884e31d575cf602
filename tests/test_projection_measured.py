"""The projection with measured compute: the device timing script in miniature feeding
`patchpar project --timings`, and the committed TPU projections (PixArt-α on 4 and 8 v5e chips,
the published TPU figures) re-derived from the chip's committed timings."""

import json
from pathlib import Path

import pytest

from patchpar.lab.cli import main
from patchpar.lab.project import timed_compute
from patchpar.measure.workload import WorkloadCache

REPO = Path(__file__).resolve().parent.parent


def _shard_timing():
    """experiments/device/shard_timing.py as a module."""
    import importlib.util

    path = REPO / "experiments" / "device" / "shard_timing.py"
    spec = importlib.util.spec_from_file_location("shard_timing", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.slow
def test_device_script_in_miniature_feeds_the_projection(micro_folder, tmp_path, capsys):
    """experiments/device/shard_timing.py as a lent GPU would run it, on the micro model; its
    records then replace the fitted compute in `patchpar project --timings`."""
    script = _shard_timing()
    out = tmp_path / "timing"
    script.main(
        [
            "--model", str(micro_folder), "--resolutions", "64", "--patches", "1", "2",
            "--repeats", "1", "--dtype", "float32", "--hardware", "cpu-gloo", "--out", str(out),
        ]
    )  # fmt: skip
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [(r["patches"], r["phase"], r["status"], r["stale_exchange"]) for r in recs] == [
        (1, "warmup", "ok", "stand_in"),
        (2, "steady", "ok", "stand_in"),
        (2, "steady", "ok", "left_out"),  # the stale exchanges left out: the overlapped program
    ]
    assert all(r["unet_call_s_median"] > 0 for r in recs)
    args = ["project", "--model", str(micro_folder), "--resolution", "64", "--devices", "2"]
    args += ["--strategy", "distrifusion", "--dtype", "float32", "--steps", "10", "--json"]
    args += ["--workloads", str(tmp_path / "w.jsonl"), "--timings", str(out / "records.jsonl")]
    capsys.readouterr()
    assert main([*args, "--hardware", "cpu-gloo"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["compute_source"] == "measured"
    # 5 exact steps (warm-up 4) with the exchanges stood in, 5 stale ones without them
    stood, left_out = (r["unet_call_s_median"] for r in recs[1:])
    assert row["compute_s"] == pytest.approx(5 * stood + 5 * left_out)
    w = WorkloadCache(tmp_path / "w.jsonl")
    wl = [x for x in w if x.devices == 2][0]
    assert timed_compute(recs, "a100-sxm", wl) is None  # other hardware: the fitted curve
    # the single program of the timed program's own attention kernel, never another kernel's
    assert recs[0]["attention"] == recs[1]["attention"] == "chunked"
    other = {**recs[0], "attention": "xla", "unet_call_s_median": 123.0}
    assert timed_compute([*recs, other], "cpu-gloo", wl)["single"] == recs[0]["unet_call_s_median"]
    assert timed_compute([other, recs[1]], "cpu-gloo", wl) is None


TPU_PROJECTION = REPO / "results" / "tpu_v5e" / "projection_in_place"


@pytest.mark.skipif(
    not (TPU_PROJECTION / "records.jsonl").is_file(), reason="no TPU projection committed"
)
def test_tpu_projection_rederived_from_its_workloads_and_the_chips_timings(tmp_path, monkeypatch):
    """The committed TPU projections (every strategy on 4 and 8 chips, and the published TPU
    figures beside one chip's) follow from the committed workloads, the chip's committed
    timings and today's profiles: a profile or pricing change shows here."""
    import importlib.util
    import shutil

    from patchpar.measure import workload

    def not_cached(*args):
        raise AssertionError(f"workload {args[:2]} missing from the committed cache")

    monkeypatch.setattr(workload, "compute_workload", not_cached)
    shutil.copy(TPU_PROJECTION / "workloads.jsonl", tmp_path / "workloads.jsonl")
    path = REPO / "experiments" / "device" / "tpu_projection.py"
    spec = importlib.util.spec_from_file_location("tpu_projection", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path)]) == 0
    for name, key in (("records.jsonl", "latency_s"), ("published.jsonl", "projected_s")):
        ours, committed = (
            [json.loads(x) for x in (folder / name).read_text().splitlines()]
            for folder in (tmp_path, TPU_PROJECTION)
        )
        assert len(ours) == len(committed) > 0
        for a, b in zip(ours, committed, strict=True):
            assert a[key] == pytest.approx(b[key], rel=1e-6), b
    assert {r["compute_source"] for r in ours} >= {"measured"}


def test_a_steady_program_timed_with_its_sends_dropped_is_no_runs_program(tmp_path):
    """shard_timing.py --stale-exchange dropped: the steady program with its stale exchange
    left out and no next state returned (on a DiT, sync_patch's with its gathers fed in) is
    timed and recorded as such, carried from call to call without a state of its own; the
    projection never takes it for a run's compute."""
    from patchpar.lab.config import build_plan

    script = _shard_timing()
    out = tmp_path / "timing"
    script.main(
        [
            "--model", "tiny-dit", "--resolutions", "64", "--patches", "2",
            "--strategies", "distrifusion", "--stale-exchange", "dropped", "--repeats", "2",
            "--dtype", "float32", "--hardware", "cpu-gloo", "--out", str(out),
        ]
    )  # fmt: skip
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [(r["patches"], r["phase"], r["status"], r["stale_exchange"]) for r in recs] == [
        (2, "steady", "ok", "dropped"),
    ]
    assert len(recs[0]["unet_call_s_all"]) == 2 and recs[0]["unet_call_s_median"] > 0
    single = {**recs[0], "patches": 1, "strategy": "single()", "stale_exchange": "stand_in"}
    recs.append(single)  # with a single program beside it, still not the run's compute
    w = WorkloadCache(tmp_path / "w.jsonl")
    wl = w.get("tiny-dit", 64, build_plan("distrifusion", {}, 2, 1), 1, "float32")
    assert wl.strategy == recs[0]["strategy"]
    assert timed_compute(recs, "cpu-gloo", wl) is None  # only a dropped program: not measured
