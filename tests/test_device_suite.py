"""experiments/device/run_all.sh, the one command a lent GPU runs, in miniature on this CPU:
every part runs, writes its records, and the per-site comparison names its exchange."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_run_all_in_miniature(micro_folder, tmp_path):
    env = {
        **os.environ,
        "MINI": "1",
        "DEST": str(tmp_path / "device"),
        "MODEL": str(micro_folder),
        "RES": "64",
        "PY": sys.executable,
        "OUT": str(tmp_path),
    }
    env.pop("XLA_FLAGS", None)  # one device, as on the GPU machine
    done = subprocess.run(
        ["bash", "experiments/device/run_all.sh"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    dest = tmp_path / "device"
    recs = {
        part: [json.loads(x) for x in (dest / part / "records.jsonl").read_text().splitlines()]
        for part in ("attention", "shard_packed", "shard_per_site", "quant")
    }
    assert all(r["status"] == "ok" for rs in recs.values() for r in rs), recs
    assert [r["attention"] for r in recs["attention"]] == ["xla", "chunked"]
    assert [r["patches"] for r in recs["shard_packed"]] == [1, 2]
    assert "comm_groups=1" in recs["shard_packed"][1]["strategy"]
    assert "comm_groups='per_site'" in recs["shard_per_site"][0]["strategy"]
    assert [r["mode"] for r in recs["quant"]] == ["none", "w8", "int8", "fp8"]
    assert recs["quant"][3]["emulated"]  # fp8 on a CPU
    assert (tmp_path / "run_all.tgz").stat().st_size > 0
    assert (dest / "machine.txt").read_text().count("jax") >= 1
