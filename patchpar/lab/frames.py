"""Records as a pandas DataFrame, for notebooks: `load_records(*paths)`.

One row per record, dotted columns (`config.strategy.name`, `metrics.psnr`,
`provenance.git_commit`), whichever command or experiment script wrote it. Every row is read
into one envelope:

- `kind`: what wrote it: `run` (`patchpar run` / `sweep`: a config, metrics, a status), or, for
  an experiment script's record, its folder and file (`bench_unet`, `memory`, `comm`,
  `latency.paper`, `speedup_cpu.collectives`, ...), unless the record names its own kind;
- `provenance.*`: git commit and dirtiness, versions, device kind, wherever the writer put them
  (scripts wrote some at the top level);
- `config.*`, `metrics.*`, `status`, `run_id`, `time` where the record has them, and every other
  field of a script's record as its own column (a `config` that is a name becomes
  `config.name`; a collective benchmark's `kind` becomes `collective`);
- `source`: the file the row came from.

Old runner records load under today's metric names (`patchpar.lab.results.upgraded`).
"""

from __future__ import annotations

import json
from pathlib import Path

from patchpar.lab.results import read_records

# fields a script's record kept at its top level that belong to its provenance
PROVENANCE_KEYS = (
    "git_commit",
    "git_dirty",
    "versions",
    "python",
    "jax",
    "jaxlib",
    "flax",
    "device_kind",
    "device_count",
    "platform",
    "cpu",
    "xla_cpu_flags",
)
FIRST = ("kind", "experiment", "label", "status", "run_id", "time", "source")


def record_files(paths) -> list[Path]:
    """The record files named: a `.jsonl` file as given, a folder's `*.jsonl` files (not its
    sub-folders). ValueError naming a path that holds none."""
    files = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise ValueError(f"no record files (*.jsonl) in {str(p)!r}")
            files += found
        elif p.is_file() and p.suffix == ".jsonl":
            files.append(p)
        elif p.is_file():
            raise ValueError(f"{str(p)!r} is not a record file (JSON lines, *.jsonl)")
        else:
            raise ValueError(f"no records at {str(p)!r} (a folder of *.jsonl files, or one)")
    return files


def file_kind(path: Path) -> str:
    """The kind of an experiment script's records from where they are: the folder, and the
    file's name unless it is the generic `runs` or `records`."""
    folder = path.parent.name
    return folder if path.stem in ("runs", "records") else f"{folder}.{path.stem}"


def envelope(record: dict, path: Path) -> dict:
    """One record in the common envelope (see the module docstring); the input is unchanged."""
    rec = dict(record)
    runner = isinstance(rec.get("config"), dict) and "metrics" in rec and "status" in rec
    if runner:
        kind = rec.pop("kind", "run")
    else:
        kind = file_kind(path)
        if "kind" in rec:  # a collective benchmark's collective kind
            rec["collective"] = rec.pop("kind")
    prov = dict(rec.pop("provenance", None) or {})
    for key in PROVENANCE_KEYS:
        if key in rec and not runner:
            prov.setdefault(key, rec.pop(key))
    if "config" in rec and not isinstance(rec["config"], dict):
        rec["config"] = {"name": rec["config"]}
    out = {"kind": kind, **rec, "provenance": prov, "source": str(path)}
    if runner:  # what makes two runs the same point (for `latest`): config and file
        config = {k: v for k, v in rec["config"].items() if k != "results"}
        out["_point"] = json.dumps(config, sort_keys=True) + str(path)
    return out


def load_records(*paths, latest: bool = False, ok_only: bool = False, shown=()):
    """A DataFrame of every record in `paths` (folders of *.jsonl files, or files), one row per
    record in file order, dotted columns. `latest`: only the newest record of each runner point
    (same config, same file). `ok_only`: only rows whose status is `ok` or unset. Run records
    get `point_label`: the strategy and every config field that differs among the run records
    returned, across files, but the `shown` ones (a plot's axis, a column of its own: e.g.
    `("mesh.devices",)`), as `patchpar table` and `plot` label them
    (`patchpar.lab.tables.point_labels`)."""
    import pandas as pd

    from patchpar.lab.tables import point_labels

    if not paths:
        raise ValueError("load_records: name at least one folder or *.jsonl file of records")
    rows = []
    for f in record_files(paths):
        rows += [envelope(r, f) for r in read_records(f, skip_bad=True)]
    if latest:
        last = {r["_point"]: i for i, r in enumerate(rows) if "_point" in r}
        rows = [r for i, r in enumerate(rows) if "_point" not in r or last[r["_point"]] == i]
    if ok_only:
        rows = [r for r in rows if r.get("status") in (None, "ok")]
    runs = [r for r in rows if "_point" in r]
    for r, label in zip(runs, point_labels(runs, shown), strict=True):
        r["point_label"] = label
    for r in rows:
        r.pop("_point", None)
    first = [*FIRST[:3], "point_label", *FIRST[3:]]
    frame = pd.json_normalize(rows, sep=".") if rows else pd.DataFrame(columns=list(FIRST))
    first = [c for c in first if c in frame.columns]
    return frame[first + [c for c in frame.columns if c not in first]].reset_index(drop=True)
