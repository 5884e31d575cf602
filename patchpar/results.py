"""Result records: one JSON object per line in results/<experiment>/runs.jsonl, written
atomically (a killed sweep loses no finished row), with provenance (DESIGN.md §7)."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import tempfile
import uuid
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path


@functools.cache
def git_commit() -> str | None:
    """The commit of the patchpar checkout this process runs (None outside git)."""
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                cwd=Path(__file__).parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return commit


@functools.cache
def git_dirty() -> bool | None:
    """Whether the checkout had uncommitted changes when this process first asked (then the
    commit alone does not say what ran). Cached like the commit, so that a commit made while a
    sweep runs cannot make its later records read clean against the older commit."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def provenance() -> dict:
    """Git commit, package versions and the device kind of this process."""
    commit = git_commit()
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    import jax

    dev = jax.devices()[0]
    return {
        "git_commit": commit,
        "git_dirty": git_dirty(),
        "versions": versions,
        "python": platform.python_version(),
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
    }


def read_records(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_record(path: Path, record: dict) -> dict:
    """Append one record (adding run id and time) by rewriting the file through a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "run_id": uuid.uuid4().hex[:12],
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        **record,
    }
    old = path.read_text() if path.is_file() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".runs-")
    with os.fdopen(fd, "w") as f:
        f.write(old + json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return record
