"""Patch weights from measured speed (`patchpar calibrate`, `--patch-weights measured`): each
device's step on its patch timed, the weights its speed relative to the fastest, floored so
that a slow device still takes one unit of rows; a run that measures them splits its rows by
them and stays exact; what cannot use them is refused in one line."""

import json

import numpy as np
import pytest
from mp_worker import can_bind_localhost

from patchpar.lab.cli import main
from patchpar.measure.calibrate import speed_weights
from patchpar.parallel.split import floored, split_rows


def test_weights_are_speeds_relative_to_the_fastest():
    assert speed_weights([0.2, 0.4, 0.1]) == (0.5, 0.25, 1.0)
    assert speed_weights([1.0, 1e6]) == (1.0, 0.001)  # never 0


def test_a_slow_device_keeps_one_unit():
    assert floored((1, 1, 1), 32, 4) == (1, 1, 1)
    w = floored((1, 0.01, 1), 32, 4)  # 0.01 of 2.01 is under one of 8 units
    assert split_rows(32, 3, 4, w)[1] == 4
    w = floored((1, 0.01, 0.02, 1), 64, 4)
    assert split_rows(64, 4, 4, w) == (28, 4, 4, 28)
    with pytest.raises(ValueError, match="fewer than its minimum"):  # without the floor
        split_rows(64, 4, 4, (1, 0.01, 0.02, 1))


@pytest.mark.slow
def test_calibrate_prints_each_devices_time_and_the_weights(tmp_path, capsys):
    out = tmp_path / "c.json"
    args = ["calibrate", "--model", "fmnist", "--devices", "3", "--repeats", "2",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    rec = json.loads(out.read_text())
    assert rec["slab"] == [12, 32]  # the largest of 12, 12, 8 rows
    assert len(rec["seconds_per_step"]) == 3 and min(rec["seconds_per_step"]) > 0
    weights = [float(w) for w in rec["patch_weights"].split(",")]
    assert max(weights) == 1.0 and len(weights) == 3
    assert f"--patch-weights {rec['patch_weights']}" in capsys.readouterr().out


def test_a_run_with_measured_weights_splits_by_them_and_stays_exact(tmp_path):
    """sync_patch on rows split by measured speed equals the one-device image."""
    base = ["generate", "--model", "fmnist", "--steps", "2", "--prompt", "a bag"]
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    got = [*base, "--devices", "3", "--strategy", "sync_patch", "--patch-weights", "measured"]
    assert main([*got, "--out", str(tmp_path / "three")]) == 0
    rec = json.loads((tmp_path / "three" / "generate.json").read_text())
    assert len(rec["patch_weights"]) == 3 and len(rec["measured_seconds_per_step"]) == 3
    one, three = (np.load(tmp_path / d / "latent.npy") for d in ("one", "three"))
    assert np.abs(three - one).max() <= 1e-4 * np.abs(one).max()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cfg", "2", "--devices", "4"], "patch_weights=measured: 2 of the 4 devices"),
        (
            ["--strategy", "naive_patch", "--fsdp"],
            "uneven patches (rows by measured speed) with strategy",
        ),  # fmt: skip
        (["--strategy", "asyncdiff", "--model", "tiny-dit"], "does not split the rows"),
    ],
)
def test_what_cannot_use_measured_weights_is_refused(flags, message, tmp_path, capsys):
    args = ["generate", "--model", "fmnist", "--devices", "3", "--strategy", "sync_patch",
            "--patch-weights", "measured", *flags, "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert len(errors) == 1 and message in errors[0], errors


def test_bad_calibrate_flags_are_one_line_each(tmp_path, capsys):
    args = ["calibrate", "--model", "fmnist", "--devices", "2", "--processes", "3",
            "--repeats", "0", "--height", "30", "--out", str(tmp_path / "c.json")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    for line in ("processes=3: must be 0 or devices=2", "repeats=0: must be >= 1",
                 "latent rows=30 are not a multiple of 4"):  # fmt: skip
        assert line in err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not can_bind_localhost(), reason="localhost cannot be bound")
def test_calibrate_over_launched_processes(tmp_path):
    """Two processes time at the same time and gather their times (process 0 writes)."""
    out = tmp_path / "c.json"
    args = ["calibrate", "--model", "fmnist", "--devices", "2", "--processes", "2",
            "--repeats", "2", "--timeout-s", "300", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    rec = json.loads(out.read_text())
    assert rec["processes"] == 2 and len(rec["seconds_per_step"]) == 2


# ----------------------------------------------------------------- a mixed node, projected


def test_a_mixed_node_waits_for_its_slowest_device():
    from patchpar import hardware
    from patchpar.measure.projection import Mixed

    a100, l40s = hardware.load("a100-sxm"), hardware.load("l40s")
    flops = 1e13
    even = Mixed((a100, l40s))
    assert even.step_compute_s(flops) == max(a100.compute_s(flops), l40s.compute_s(flops))
    weighted = Mixed((a100, l40s), rows=(80, 48))  # the L40S a share of 48/80 of the largest
    own = weighted.step_compute_s(flops, own_rows=True)
    assert own == max(a100.compute_s(flops), l40s.compute_s(flops * 48 / 80))
    assert weighted.step_compute_s(flops, own_rows=False) == even.step_compute_s(flops)
    assert weighted.single is (a100 if a100.compute_s(flops) < l40s.compute_s(flops) else l40s)


def chip(tmp_path, name: str, peak: float) -> str:
    """A100-SXM's profile with another peak and no fixed cost per call (a tiny model on a
    chip of a thousandth of its peak: its steps are FLOPs, as a full-size model's on the
    chip itself)."""
    from patchpar import hardware

    text = (hardware.FOLDER / "a100-sxm.yaml").read_text()
    text = text.replace("name: a100-sxm", f"name: {name}").replace("312.0e+12", peak)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace("call_overhead_s: 0.017637", "call_overhead_s: 0.0"))
    return str(path)


def test_rows_weighted_by_the_profiles_cut_a_mixed_nodes_latency(tmp_path, capsys):
    """A stale DiT on a node of a fast and a 3x slower chip: rows in proportion to each chip's
    projected speed beat the even split (the steady phase computes own rows; the warm-up
    pads)."""
    node = f"{chip(tmp_path, 'fast', '312.0e+9')},{chip(tmp_path, 'slow', '104.0e+9')}"
    base = ["project", "--model", "tiny-dit", "--resolution", "512", "--devices", "2",
            "--strategy", "distrifusion", "--hardware", node, "--json",
            "--workloads", str(tmp_path / "w.jsonl")]  # fmt: skip
    rows = {}
    for weights in ("", "measured"):
        assert main([*base, "--patch-weights", weights] if weights else base) == 0
        rows[weights] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    even, measured = rows[""], rows["measured"]
    assert even["hardware"] == "fast,slow" and even["patch_rows"] is None
    assert measured["patch_rows"] == [48, 16]  # speeds 3:1
    assert measured["latency_no_decode_s"] < even["latency_no_decode_s"]


def test_a_mixed_node_is_one_profile_per_patch_device(capsys):
    args = ["project", "--model", "tiny-dit", "--devices", "4", "--strategy", "distrifusion",
            "--hardware", "a100-sxm,l40s"]  # fmt: skip
    assert main(args) == 2
    assert "2 profiles for 4 patch device(s)" in capsys.readouterr().err
    assert main(["project", "--model", "tiny-dit", "--devices", "2", "--patch-weights",
                 "measured", "--strategy", "distrifusion"]) == 2  # fmt: skip
    assert "give one per patch device (--hardware a100-sxm,l40s)" in capsys.readouterr().err
