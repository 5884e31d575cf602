"""`patchpar sweep SWEEP.yaml`: a grid of runs over dotted keys on top of a base config, one
record per point, resumable.

A sweep file:

    experiment: devices_strategy        # the records' folder (default: the file's name)
    base: ../configs/tiny.yaml          # a RunConfig YAML, relative to this file (optional)
    set: {sampler.steps: 20}            # dotted overrides for every point (optional)
    points:                             # listed points, each a mapping of overrides (optional)
      - {strategy.name: single, mesh.devices: 1}
    grid:                               # cross product over dotted keys (optional)
      mesh.devices: [2, 4, 8]
      strategy: [{name: distrifusion}, {name: pcpp, send: band}]

Points = points x grid (either may be absent); `grid` may also be a list of such mappings,
whose cross products are joined (one grid for `single` on 1 device, one for the rest). A value for a key naming a sub-config
(`strategy`) replaces that whole sub-config. Every point is built and type-checked before
anything runs (an unknown key stops the sweep with an error naming it); a point that fails
while running becomes a record with its status and error, and the sweep goes on. Points whose
config is already recorded in `runs.jsonl` are skipped, so a killed sweep resumes where it was.

Records go to `<results>/<experiment>/runs.jsonl`: `runs/` unless `--results` says otherwise
(the published records under `results/` are written only when asked), and the experiment is
the sweep file's name unless the file names one, never the base config's.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from patchpar.lab.config import RunConfig
from patchpar.lab.configio import load_config, read_yaml, with_overrides
from patchpar.lab.results import read_records

SWEEP_KEYS = ("experiment", "base", "set", "points", "grid")


@dataclass(frozen=True)
class SweepConfig:
    """Run every point of a sweep file that is not recorded yet."""

    file: Annotated[Path, tyro.conf.Positional]
    """The sweep YAML (see experiments/sweeps/)."""
    results: Path | None = None
    """Root folder of the records (default `runs/`, git-ignored; the published records are
    under `results/`)."""
    retry_failed: bool = False
    """Run again the points recorded with status error or oom (a new row each)."""
    dry_run: bool = False
    """List the points, where they write, and whether each is recorded, would run, or fails
    its checks (every check a run makes before generating); run nothing."""
    processes: int | None = None
    """Run every point in launched processes, one per device (one core and thread each):
    `single` on 1, the others on this many (their mesh.devices must be it). Sets each point's
    mesh.processes; unset keeps the sweep file's."""


def load_sweep(
    path: str | Path, results: Path | None = None, processes: int | None = None
) -> list[RunConfig]:
    """The sweep's points as configs, in order; ValueError naming a bad key or value."""
    path = Path(path)
    spec = read_yaml(path, "sweep file")
    if not spec:
        raise ValueError(
            f"{path}: empty sweep file; give at least `base:` and `points:` or `grid:` "
            "(see experiments/sweeps/)"
        )
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a mapping with keys {list(SWEEP_KEYS)}")
    unknown = sorted(set(spec) - set(SWEEP_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; a sweep has {list(SWEEP_KEYS)}")
    base = load_config(path.parent / spec["base"]) if spec.get("base") else RunConfig()
    common = dict(spec.get("set") or {})
    # the sweep's own folder: never the base config's (which may hold other records)
    common["experiment"] = spec.get("experiment") or common.get("experiment") or path.stem
    if results is not None:
        common["results"] = str(results)
    listed = spec.get("points") or [{}]
    grids = spec.get("grid") or {}
    grids = grids if isinstance(grids, list) else [grids]
    if not isinstance(listed, list) or not all(isinstance(p, dict) for p in listed):
        raise ValueError(f"{path}: `points` must be a list of mappings of dotted keys")
    for grid in grids:
        if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
            raise ValueError(
                f"{path}: `grid` must map dotted keys to non-empty lists of values (or be a "
                f"list of such mappings); got {grid!r}"
            )
    combos = [dict(zip(g, c, strict=True)) for g in grids for c in itertools.product(*g.values())]
    configs = []
    for point in listed:
        for combo in combos:
            overrides = {**common, **point, **combo}
            try:
                cfg = with_overrides(base, overrides)
                if processes is not None:
                    n = 1 if cfg.mesh.devices == 1 else processes
                    cfg = with_overrides(cfg, {"mesh.processes": n})
                configs.append(cfg)
            except ValueError as e:
                raise ValueError(f"{path}: point {overrides}: {e}") from None
    if processes is not None:  # every point must run in them: refused up front, not one by one
        other = sorted({c.mesh.devices for c in configs} - {1, processes})
        if other:
            raise ValueError(
                f"--processes {processes}: {path} has points on {other} device(s), and a "
                f"launched process holds one device (a point on 1 device runs in 1 process, the "
                f"others in {processes}); use --processes with a sweep whose points are on 1 or "
                f"{processes} devices, or set mesh.processes in the sweep file per point"
            )
    return configs


def run_sweep(config: SweepConfig) -> list[dict]:
    """Run the points not yet recorded; returns the records of this sweep's points (old and
    new, the latest per point), in sweep order."""
    from tqdm import tqdm

    from patchpar.lab.launch import request_cpu_devices
    from patchpar.lab.runner import point_key, run, runs_path

    if config.processes is not None and config.processes < 1:
        raise ValueError(f"processes={config.processes}: must be >= 1 (or unset)")
    points = load_sweep(config.file, config.results, config.processes)
    in_process = [cfg.mesh.devices for cfg in points if not cfg.mesh.processes]
    if in_process:
        request_cpu_devices(max(in_process), tqdm.write)

    def index() -> dict:  # (runs file, point) -> its latest record
        return {
            (path, point_key(r["config"])): r
            for path in {runs_path(cfg) for cfg in points}
            for r in read_records(path, skip_bad=True, require=("config", "status"))
        }

    done = index()
    todo = []
    for cfg in points:
        prev = done.get((runs_path(cfg), point_key(cfg)))
        if prev is None or (config.retry_failed and prev["status"] != "ok"):
            todo.append(cfg)
    if config.dry_run:
        print(dry_run(points, todo))
        return []
    skipped = len(points) - len(todo)
    if skipped:
        print(
            f"{skipped} of {len(points)} points already recorded in {runs_path(points[0])}; skipped"
        )
    for msg in dict.fromkeys(m for cfg in todo for m in _unused(cfg)):  # each once
        print(f"patchpar: warning: {msg}", file=sys.stderr, flush=True)
    bar = tqdm(todo, desc="sweep", unit="point")
    for i, cfg in enumerate(bar, 1):
        bar.set_postfix_str(f"{cfg.label()} on {cfg.mesh.devices}")
        rec = run(cfg, log=tqdm.write, warn=False, tag=f"[{i}/{len(todo)}] ")
        if rec["status"] != "ok":
            tqdm.write(f"  point failed ({rec['status']}): {rec['error']}")
    done = index()
    keys = [(runs_path(cfg), point_key(cfg)) for cfg in points]
    return [done[k] for k in keys if k in done]


def _unused(cfg: RunConfig) -> list[str]:
    from patchpar.lab.config import unused_options

    try:
        cfg.validate()
    except ValueError:  # recorded as an invalid point, with its reason
        return []
    return unused_options(cfg)


def dry_run(points: list[RunConfig], todo: list[RunConfig]) -> str:
    """One line per point: recorded / to run / invalid (with the reason), its label (the
    strategy and the fields that tell it apart from the other points) and mesh; then where
    the records go."""
    from patchpar.lab.configio import to_dict
    from patchpar.lab.runner import preflight, runs_path
    from patchpar.lab.tables import point_labels

    labels = point_labels(
        [{"label": c.label(), "config": to_dict(c)} for c in points],
        shown=("mesh.devices", "mesh.cfg", "mesh.data", "mesh.fsdp", "mesh.processes"),
    )
    lines = []
    for cfg, label in zip(points, labels, strict=True):
        state, why = ("to run" if cfg in todo else "recorded"), ""
        if cfg in todo:
            try:
                preflight(cfg)
            except ValueError as e:
                state, why = "invalid", f"  <- {'; '.join(' '.join(x.split()) for x in _lines(e))}"
        lines.append(
            f"{state:9s} {label} | devices={cfg.mesh.devices} cfg={cfg.mesh.cfg}"
            + (f" data={cfg.mesh.data}" if cfg.mesh.data > 1 else "")
            + (" fsdp" if cfg.mesh.fsdp else "")
            + (f" processes={cfg.mesh.processes}" if cfg.mesh.processes else "")
            + why
        )
    for path in dict.fromkeys(runs_path(c) for c in points):
        lines.append(f"records -> {path}")
    return "\n".join(lines)


def _lines(e: ValueError) -> list[str]:
    """A bad point's problems: one per line of a `Problems`, else the one message."""
    from patchpar.lab.checks import Problems

    return e.lines if isinstance(e, Problems) else [str(e)]
