"""Result records: one JSON object per line in results/<experiment>/runs.jsonl, written
atomically (a killed sweep loses no finished row), with provenance (docs/design.md §6)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import platform
import stat
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from patchpar.lab.paths import PUBLISHED

COMMIT_ENV = "PATCHPAR_GIT_COMMIT"


@functools.cache
def git_commit() -> str | None:
    """The commit of the patchpar checkout this process runs (None outside git).
    PATCHPAR_GIT_COMMIT, where set, names it instead: a copy of a committed tree run elsewhere
    (a lent device machine), whose own `.git`, if it has one, need not be the tree's."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
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
    commit alone does not say what ran): a changed tracked file outside results/, or an
    untracked file under patchpar/ (a new module runs but is in no commit). Records, tables and
    plots under results/ are what runs write, not what runs: changing them does not count.
    Cached like the commit, so that a commit made while a sweep runs cannot make its later
    records read clean against it. None where PATCHPAR_GIT_COMMIT names the commit: not
    known on the copy."""
    if os.environ.get(COMMIT_ENV):
        return None
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return any(_counts_as_dirty(line) for line in out.stdout.splitlines())


def _counts_as_dirty(porcelain_line: str) -> bool:
    """A `git status --porcelain` line: tracked changes count outside results/, untracked
    files only inside the package (results and scratch files do not change what runs)."""
    if not porcelain_line.strip():
        return False
    path = porcelain_line[3:].strip('"')
    if porcelain_line.startswith("??"):
        return path.startswith("patchpar/")
    return not path.startswith("results/")


def provenance() -> dict:
    """Git commit, package versions, the device kind and patchpar's XLA:CPU options of this
    process."""
    from patchpar.xla_flags import in_effect

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
        "xla_cpu_flags": in_effect(),
    }


# Metric keys of the phases: the warm-up phase (exact exchanges) was once called `sync`. Records
# written before keep loading, under the names of today (`upgraded`); the files stay as written.
PHASE_STEPS = {"warmup": "warmup_phase_steps", "steady": "steady_steps"}
RENAMED_METRICS = {"sync_steps": "warmup_phase_steps", "sync_step_s_median": "warmup_step_s_median"}


def upgraded(record: dict) -> dict:
    """A record as today's code reads it: old metric names mapped to today's."""
    metrics = record.get("metrics")
    if not isinstance(metrics, dict) or not set(RENAMED_METRICS) & set(metrics):
        return record
    metrics = {RENAMED_METRICS.get(k, k): v for k, v in metrics.items()}
    return {**record, "metrics": metrics}


def check_writable(folder: Path, what: str) -> Path:
    """Check, before any work, that files can be written in `folder` (or, where it does not
    exist yet, that it can be made: its nearest existing parent takes a file), without making
    anything: a run that then fails its checks leaves no empty folder behind. ValueError
    naming the folder and the reason otherwise."""
    folder = Path(folder)
    probe_in = folder
    while not os.path.lexists(probe_in) and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    try:
        if probe_in.is_symlink() and not probe_in.exists():
            raise FileNotFoundError(2, f"{str(probe_in)!r} is a link to nothing")
        if not probe_in.is_dir():
            raise NotADirectoryError(20, f"{str(probe_in)!r} is a file, not a folder")
        fd, probe = tempfile.mkstemp(dir=probe_in, prefix=".patchpar-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ValueError(f"{what}={str(folder)!r}: cannot write there ({reason})") from None
    return folder


def published(path: Path) -> bool:
    """Whether `path` lies in this checkout's committed records, `results/` beside the package
    (`patchpar.lab.paths.PUBLISHED`): written only where a command is told that folder."""
    root = Path(__file__).resolve().parents[2] / PUBLISHED
    return Path(path).resolve().is_relative_to(root)


class RecordError(ValueError):
    """A line of a runs.jsonl that is not a usable record (the message names file and line)."""


def _warn(msg: str) -> None:
    print(f"patchpar: warning: {msg}", file=sys.stderr, flush=True)


def read_records(
    path: Path, skip_bad: bool = False, require: tuple[str, ...] = (), warn=_warn
) -> list[dict]:
    """The records of a runs.jsonl (none if the file is absent). A line that is not a JSON
    object, or lacks a key in `require`, raises RecordError naming the file and line number;
    with `skip_bad` it is skipped and `warn` says which (sweep, table and plot do that)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        problem = None
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg} at column {e.colno})"
        else:
            if not isinstance(rec, dict):
                problem = f"a JSON {type(rec).__name__}, not a record object"
            elif missing := [k for k in require if k not in rec]:
                problem = f"a record without {missing}"
        if problem is None:
            out.append(upgraded(rec))
        elif skip_bad:
            warn(f"{path}:{number}: {problem}; skipped")
        else:
            raise RecordError(f"{path}:{number}: {problem}")
    return out


def append_record(path: Path, record: dict) -> dict:
    """Append one record (adding run id and time), atomically: under an exclusive lock on the
    folder (two processes appending to one file lose no row), the file is rewritten to a temp
    file with the old file's permissions, fsynced, renamed over it, and the folder is fsynced.
    A failure removes the temp file and leaves the old file as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "run_id": uuid.uuid4().hex[:12],
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        **record,
    }
    line = json.dumps(record, sort_keys=True) + "\n"
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        old = path.read_text() if path.is_file() else ""
        if old and not old.endswith("\n"):
            old += "\n"
        mode = stat.S_IMODE(path.stat().st_mode) if path.is_file() else 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".runs-")
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), mode)
                f.write(old + line)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)  # closing releases the lock
    return record


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
