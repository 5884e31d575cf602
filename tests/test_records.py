"""Records and provenance: concurrent appends lose no row, malformed lines are named (and
skipped where a command can go on), permissions and temp files, the dirty flag, weights digests.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from patchpar.lab.config import RunConfig
from patchpar.lab.configio import with_overrides
from patchpar.lab.results import RecordError, _counts_as_dirty, append_record, read_records

WRITER = """
import sys
from patchpar.lab.results import append_record
for i in range(int(sys.argv[3])):
    append_record(sys.argv[1], {"writer": sys.argv[2], "i": i, "pad": "x" * 20000})
"""


def test_two_concurrent_writers_lose_no_row(tmp_path):
    path = tmp_path / "runs.jsonl"
    n = 40
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), name, str(n)],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        for name in ("a", "b")
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    rows = read_records(path)
    assert len(rows) == 2 * n
    assert sorted((r["writer"], r["i"]) for r in rows) == [
        (w, i) for w in ("a", "b") for i in range(n)
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".runs-")]


def test_malformed_line_is_named_and_skipped_where_asked(tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    append_record(path, {"config": {}, "status": "ok"})
    with open(path, "a") as f:
        f.write('{"config": {}, "status": "ok", "cut off\n')  # a torn line
        f.write("[1, 2]\n")  # JSON, but no record
        f.write('{"status": "ok"}\n')  # a record without its config
    with pytest.raises(RecordError, match=r"runs\.jsonl:2: not valid JSON"):
        read_records(path)
    got = read_records(path, skip_bad=True, require=("config",))
    assert len(got) == 1
    err = capsys.readouterr().err
    for line, what in (
        (2, "not valid JSON"),
        (3, "a JSON list"),
        (4, "a record without ['config']"),
    ):
        assert f"runs.jsonl:{line}: {what}" in err
    # table reads the good record and says which it skipped
    from patchpar.lab.tables import read_runs

    assert len(read_runs([tmp_path])) == 1
    assert "runs.jsonl:4: a record without ['config']; skipped" in capsys.readouterr().err


def test_append_keeps_permissions_and_removes_temp_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    append_record(path, {"i": 0})
    # a new file gets the umask's permissions, not mkstemp's 0600
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    path.chmod(0o640)
    append_record(path, {"i": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    before = path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        append_record(path, {"i": 2})
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.jsonl"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_dirty_flag_counts_untracked_package_files_only():
    assert _counts_as_dirty(" M README.md")  # tracked change anywhere
    assert _counts_as_dirty("?? patchpar/lab/new_module.py")  # runs, but in no commit
    assert not _counts_as_dirty("?? results/scratch/runs.jsonl")
    assert not _counts_as_dirty(" M results/comm/runs.jsonl")  # what runs write, not what runs
    assert not _counts_as_dirty(" D results/fmnist_quality/table.md")
    assert _counts_as_dirty(" M experiments/sweeps/quality.yaml")
    assert not _counts_as_dirty("?? notes.txt")
    assert not _counts_as_dirty("")


def test_weights_digest_in_provenance_and_baseline_key(micro_folder, tmp_path):
    from patchpar.lab.baselines import baseline_key, weights_sha256
    from patchpar.models.loading import weights_digest

    copy = tmp_path / "model"
    shutil.copytree(micro_folder, copy)
    cfg = with_overrides(RunConfig(), {"model.name": str(copy)})
    digest, key = weights_sha256(cfg), baseline_key(cfg)
    assert digest == weights_digest(micro_folder) and len(digest) == 16
    # other weights under the same name: another digest and another baseline
    weights = next(copy.glob("unet/*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert weights_sha256(cfg) != digest and baseline_key(cfg) != key
    missing = with_overrides(RunConfig(), {"model.name": str(tmp_path / "absent")})
    assert weights_sha256(missing) is None  # the run itself reports the missing folder


def test_record_provenance_names_the_weights(tmp_path, micro_folder):
    from patchpar.lab.runner import run

    cfg = with_overrides(
        RunConfig(),
        {
            "model.name": str(micro_folder),
            "results": str(tmp_path),
            "sampler.steps": 2,
            "sampler.height": 32,
            "measure.repeats": 1,
            "measure.warmup_runs": 0,
            "measure.comm": False,
            "measure.quality": [],
            "measure.save_images": False,
        },
    )
    rec = run(cfg, log=lambda m: None)
    assert rec["status"] == "ok", rec.get("error")
    line = json.loads(Path(tmp_path / "default" / "runs.jsonl").read_text().splitlines()[-1])
    assert line["provenance"]["weights_sha256"] == rec["provenance"]["weights_sha256"]
    assert isinstance(line["provenance"]["git_dirty"], bool | None)
