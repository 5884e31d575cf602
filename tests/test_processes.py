"""Real processes: workers launched by patchpar.lab.launch, joined by jax.distributed (gloo),
one CPU device each. Every launch has a timeout; the tests are skipped only where localhost
cannot be bound."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from patchpar.lab import launch
from patchpar.lab.launch import WorkerFailed

HERE = Path(__file__).resolve().parent
WORKER = (str(HERE / "mp_worker.py"),)


def _can_bind() -> bool:
    try:
        launch.free_port()
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _can_bind(), reason="localhost cannot be bound")


def _quiet(msg: str) -> None:
    print(msg, file=sys.stderr)


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


def test_two_processes_equal_one_device_and_two_fake_devices(tmp_path):
    """sync_patch over 2 processes equals the single device (<= 1e-4 relative, the engine's
    tolerance); distrifusion and pcpp equal themselves on 2 fake devices in one process."""
    from mp_worker import final_latents

    out = tmp_path / "latents.npz"
    launch.launch(["denoise", str(out)], 2, timeout_s=300, log=_quiet, program=WORKER)
    got = dict(np.load(out))
    assert _rel(got["sync_patch"], _single_latent()) <= 1e-4
    fake = final_latents(2)
    for name in ("distrifusion", "pcpp"):
        assert _rel(got[name], fake[name]) <= 1e-5, name
    # the stale strategies differ from sync_patch, so the comparison above can fail
    assert _rel(got["distrifusion"], got["sync_patch"]) > 1e-5


def test_a_dead_worker_ends_the_launch_naming_its_rank():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker rank 1 of 2 exited with code 7"):
        launch.launch(["die", "1"], 2, timeout_s=120, log=_quiet, program=WORKER)
    assert time.monotonic() - t0 < 120


def test_a_hung_launch_is_ended_at_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"timeout: worker rank\(s\) \[0, 1\] of 2"):
        launch.launch(["hang"], 2, timeout_s=20, log=_quiet, program=WORKER)
    assert time.monotonic() - t0 < 60


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append((int(entry.name), cmd))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_killed_worker_leaves_an_error_record_and_the_file_intact(micro_folder, tmp_path):
    results = tmp_path / "results"
    runs = results / "mp" / "runs.jsonl"
    runs.parent.mkdir(parents=True)
    old = json.dumps({"run_id": "old", "config": {}, "status": "ok"}) + "\n"
    runs.write_text(old)
    cmd = [sys.executable, "-m", "patchpar.lab.cli", "run", "--model.name", str(micro_folder),
           "--strategy.name", "sync_patch", "--mesh.devices", "2", "--processes", "2",
           "--sampler.steps", "2", "--sampler.height", "64", "--experiment", "mp",
           "--results", str(results)]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, victim = time.monotonic() + 120, None
        while victim is None and time.monotonic() < deadline and p.poll() is None:
            victim = next((c for c, line in _children(p.pid) if "--process-id 1" in line), None)
            time.sleep(0.2)
        assert victim is not None, "rank 1 never started"
        time.sleep(2)  # let it join the others
        os.kill(victim, signal.SIGKILL)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err[-2000:]
    assert "worker rank 1 of 2 killed by signal 9" in err
    lines = runs.read_text().splitlines(keepends=True)
    assert lines[0] == old and len(lines) == 2
    rec = json.loads(lines[1])
    assert rec["status"] == "error" and "rank 1" in rec["error"]
    assert rec["config"]["mesh"]["processes"] == 2


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
    assert (df["sync_steps"], df["steady_steps"]) == (2, 2)
    assert df["steady_step_s_median"] > 0 and sync["steady_step_s_median"] is None
    assert df["bytes_per_device_per_step"] > 0 and "psnr" in df
    assert df["latent_max_abs_diff"] < 1.0 and sync["latent_max_abs_diff"] < 1e-3


# ------------------------------------------------------------------------- bad input, no workers


def test_processes_must_match_the_devices(capsys):
    from patchpar.lab.cli import main

    code = main(["run", "--strategy.name", "sync_patch", "--mesh.devices", "4", "--processes", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "mesh.processes=2" in err and "mesh.devices=4" in err


def test_a_busy_coordinator_port_is_refused_with_another_to_try():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(
            ValueError, match=rf"127.0.0.1:{port}: the port is in use.*pick another"
        ):
            launch._check_free("127.0.0.1", port)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--coordinator", "h:1"], "missing"),
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], r"\[0, --num"),
        (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], ">= 1"),
        (["--distributed", "--process-id", "0"], "alternatives"),
    ],
)
def test_cluster_flags_are_checked(flags, message):
    with pytest.raises(ValueError, match=message):
        launch.pop_cluster_flags(["run", *flags])


def test_cluster_flags_are_taken_out_of_the_command():
    rest, cluster = launch.pop_cluster_flags(
        [
            "run",
            "a.yaml",
            "--coordinator=10.0.0.1:4000",
            "--num-processes",
            "4",
            "--process-id",
            "3",
        ]
    )
    assert rest == ["run", "a.yaml"]
    assert cluster == launch.Cluster("10.0.0.1:4000", 4, 3)
    assert launch.pop_cluster_flags(["run", "--distributed"])[1] == launch.Cluster(auto=True)
    assert launch.pop_cluster_flags(["run"]) == (["run"], None)


def test_more_processes_than_cores_is_a_warning_and_recorded():
    have = len(launch.cores())
    lay = launch.layout(have + 1)
    assert lay["oversubscribed"] and lay["cores"][have] == lay["cores"][0]
    said = []
    launch.warn_oversubscribed(have + 1, said.append)
    assert f"{have + 1} processes on {have} core(s)" in said[0]
    assert not launch.layout(1)["oversubscribed"]


def test_fake_devices_have_no_speedup(tmp_path):
    from patchpar.lab.config import RunConfig, with_overrides
    from patchpar.lab.speedup import speedups

    cfg = with_overrides(RunConfig(), {"strategy.name": "sync_patch", "mesh.devices": 2})
    metrics = {"denoise_s_median": 1.0, "step_s_median": 0.1,
               "layout": {"platform": "cpu", "processes": 1}}  # fmt: skip
    out = speedups(cfg, metrics, tmp_path / "runs.jsonl")
    assert out["speedup_vs_single"] is None and "fake CPU devices" in out["speedup_note"]
    assert "--processes 2" in out["speedup_note"]
