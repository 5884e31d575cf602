"""The launcher: a dead, hung or killed worker ends the run (naming its rank) within a timeout,
and bad input is refused. Every launch has a timeout; skipped only where localhost cannot be
bound."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mp_worker import WORKER_PROGRAM, can_bind_localhost, quiet

from patchpar.lab import launch
from patchpar.lab.launch import WorkerFailed

pytestmark = pytest.mark.skipif(not can_bind_localhost(), reason="localhost cannot be bound")


@pytest.mark.slow
def test_a_dead_worker_ends_the_launch_naming_its_rank():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker rank 1 of 2 exited with code 7"):
        launch.launch(["die", "1"], 2, timeout_s=120, log=quiet, program=WORKER_PROGRAM)
    assert time.monotonic() - t0 < 120


@pytest.mark.slow
def test_a_hung_launch_is_ended_at_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"timeout: worker rank\(s\) \[0, 1\] of 2"):
        launch.launch(["hang"], 2, timeout_s=8, log=quiet, program=WORKER_PROGRAM)
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
    from patchpar.lab.config import RunConfig
    from patchpar.lab.configio import with_overrides
    from patchpar.lab.speedup import speedups

    cfg = with_overrides(RunConfig(), {"strategy.name": "sync_patch", "mesh.devices": 2})
    metrics = {"denoise_s_median": 1.0, "step_s_median": 0.1,
               "layout": {"platform": "cpu", "processes": 1}}  # fmt: skip
    out = speedups(cfg, metrics, tmp_path / "runs.jsonl")
    assert out["speedup_vs_single"] is None and "fake CPU devices" in out["speedup_note"]
    assert "--processes 2" in out["speedup_note"]


def test_generate_starts_its_fake_cpu_devices_before_checking_its_plan():
    """The plan's checks build the mesh: the devices are asked for first (here the plan is
    refused for its steps, not for devices that are not there)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "patchpar.lab.cli", "generate", "--model", "tiny", "--devices",
           "2", "--strategy", "distrifusion", "--warmup-steps", "5", "--steps", "2"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "starting JAX with 2 CPU devices" in res.stderr
    assert "warmup_steps=5 must be < steps=2" in res.stderr and "present" not in res.stderr


@pytest.mark.slow
def test_devices_beyond_those_present_start_fake_cpu_devices_and_say_so():
    """`--devices N` on CPU without XLA_FLAGS: patchpar sets the device count itself."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "patchpar.lab.cli", "comm", "--model", "tiny", "--resolution",
           "128", "--strategy", "sync_patch", "--devices", "4", "--dtype", "float32", "--json",
           "--no-memory"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "starting JAX with 4 CPU devices" in res.stderr and "--processes 4" in res.stderr
    assert json.loads(res.stdout.splitlines()[-1])["devices"] == 4


def test_a_worker_that_cannot_load_the_model_reports_it_with_its_rank(tmp_path, micro_folder):
    """Its config.json is sound (the launcher's checks pass), its weights are not: the worker
    fails to load them and says so with its rank."""
    import shutil

    missing = tmp_path / "broken-model"
    shutil.copytree(micro_folder, missing)
    for weights in (missing / "unet").glob("*.safetensors"):
        weights.write_bytes(b"")
    cmd = [sys.executable, "-m", "patchpar.lab.cli", "run", "--model.name", str(missing),
           "--processes", "1", "--experiment", "mp", "--results", str(tmp_path / "results")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode in (1, 2), res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("patchpar: error: worker rank 0 of 1 exited") and str(missing) in last
    (rec,) = [json.loads(x) for x in (tmp_path / "results/mp/runs.jsonl").read_text().splitlines()]
    assert rec["status"] == "error" and str(missing) in rec["error"]


@pytest.mark.parametrize("with_data", [True, False])  # today's records, and those from before
def test_speedup_finds_the_single_run_of_the_point(tmp_path, with_data):
    from patchpar.lab.config import RunConfig
    from patchpar.lab.configio import to_dict, with_overrides
    from patchpar.lab.speedup import speedups

    single = to_dict(with_overrides(RunConfig(), {"mesh.processes": 1}))
    if not with_data:  # a record from before the data axis and FSDP
        del single["mesh"]["data"], single["mesh"]["fsdp"]
    record = {"config": single, "status": "ok",
              "metrics": {"denoise_s_median": 3.0, "step_s_median": 0.3}}  # fmt: skip
    (tmp_path / "runs.jsonl").write_text(json.dumps(record) + "\n")
    cfg = with_overrides(
        RunConfig(), {"strategy.name": "ring", "mesh.devices": 2, "mesh.processes": 2}
    )
    metrics = {"denoise_s_median": 2.0, "step_s_median": 0.2,
               "layout": {"platform": "cpu", "processes": 2}}  # fmt: skip
    out = speedups(cfg, metrics, tmp_path / "runs.jsonl")
    assert out["speedup_vs_single"] == pytest.approx(1.5) and out["speedup_note"] is None
