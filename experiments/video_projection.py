"""Projected Wan latencies (`patchpar project`) beside the published ones and beside patchpar's own
TPU v5e timings, with the error of every point. No constant is fitted on any of them: each
profile's compute constants are its own (the TPU profiles borrow a100-sxm's fit on image models),
its collectives its data sheet's; the published figures are read from the points below, the
measured ones from the committed TPU v5e records.

    XLA_FLAGS=--xla_force_host_platform_device_count=16 .venv/bin/python \\
        experiments/video_projection.py --out results/video_projection

Each point lowers its plan and the one-device plan of full-size Wan with abstract bf16 weights
(the workload cache `--workloads`, default <out>/workloads.jsonl: a point lowered once is not
lowered again). Writes <out>/runs.jsonl (resumable) and <out>/table.md. `--grid`: instead, every
strategy on 8 devices for Wan 2.1 1.3B and 14B at 480p and 720p x 81 frames (frames layout: the
layouts cost the same, results/video_comm), projected on GRID_PROFILES: <out>/grid.jsonl and
<out>/grid.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from patchpar.lab.config import AbstractModel, CacheConfig, DecodeMesh, StrategyConfig
from patchpar.lab.project import ProjectConfig, run_project
from patchpar.lab.results import append_record, provenance, read_records

OUT = Path("runs/video_projection")
V5E = Path("results/tpu_v5e")


@dataclass(frozen=True)
class Point:
    """A published (or measured) figure and the plan patchpar projects for it."""

    name: str
    source: str
    model: str  # the preset whose shapes it runs (Wan 2.2 A14B: each expert is a 14B)
    size: tuple[int, int, int]  # height, width, frames
    steps: int
    devices: int
    cfg: int
    strategy: str
    hardware: str
    figure: str  # what is compared: latency_s (end to end) | speedup | call_s (one call)
    published: float | None = None  # None: read from `measured`
    measured: tuple[str, str] | None = None  # (records file under results/tpu_v5e, strategy)
    note: str = ""
    options: dict = field(default_factory=dict)


POINTS = (
    Point("MaxDiffusion Wan 2.2 A14B, v7x-8, dp2 x context4 (flash)",
          "ANCHORS.md: MaxDiffusion README", "wan2.1-14b", (720, 1280, 81), 40, 8, 2,
          "ulysses", "tpu-v7x", "latency_s", 194.4,
          note="context over heads: Ulysses; dp2: the CFG halves"),
    Point("MaxDiffusion Wan 2.2 A14B, v7x-8, dp2 x context4 (ring)",
          "ANCHORS.md: MaxDiffusion README", "wan2.1-14b", (720, 1280, 81), 40, 8, 2,
          "ring", "tpu-v7x", "latency_s", 201.7),
    Point("MaxDiffusion Wan 2.2 A14B, v7x-16", "ANCHORS.md: MaxDiffusion README", "wan2.1-14b",
          (720, 1280, 81), 40, 16, 2, "ulysses", "tpu-v7x", "latency_s", 106.0,
          note="mesh not published: dp2 x context8 assumed"),
    Point("MaxDiffusion Wan 2.1 14B, v7x-16", "ANCHORS.md: MaxDiffusion README", "wan2.1-14b",
          (720, 1280, 81), 50, 16, 2, "ulysses", "tpu-v7x", "latency_s", 127.1,
          note="mesh not published: dp2 x context8 assumed"),
    Point("SGLang Ring, Wan 2.2 TI2V-5B, 2 GPUs (speedup)", "ANCHORS.md: SGLang",
          "wan2.2-5b", (704, 1280, 121), 50, 2, 1, "ring", "h100-sxm", "speedup", 1.42,
          note="GPU, size and steps not published: H100, the model's 704x1280x121, 50 assumed"),
    Point("patchpar, Wan 2.1 1.3B 480p, one v5e chip (one call)", "results/tpu_v5e/video",
          "wan2.1-1.3b", (480, 832, 81), 50, 1, 1, "single", "tpu-v5e", "call_s",
          measured=("video/records.jsonl", "single")),
    Point("patchpar, Wan 2.1 1.3B 720p, one v5e chip (one call)", "results/tpu_v5e/video",
          "wan2.1-1.3b", (720, 1280, 81), 50, 1, 1, "single", "tpu-v5e", "call_s",
          measured=("video/records.jsonl", "single")),
    Point("patchpar, Wan 2.2 TI2V-5B 704x1280x121, one v5e chip (one call)",
          "results/tpu_v5e/video_5b", "wan2.2-5b", (704, 1280, 121), 50, 1, 1, "single",
          "tpu-v5e", "call_s", measured=("video_5b/records.jsonl", "single")),
)  # fmt: skip


GRID_MODELS = ("wan2.1-1.3b", "wan2.1-14b")
GRID_SIZES = ((480, 832, 81), (720, 1280, 81))
GRID_STRATEGIES = ("sync_patch", "distrifusion", "pcpp", "ring", "ulysses")
GRID_PROFILES = ("h100-sxm", "tpu-v5e", "tpu-v7x")
GRID_DEVICES, GRID_STEPS = 8, 50


def grid(out: Path, workloads: Path) -> None:
    """Every grid point on every grid profile, one record each (resumable)."""
    runs = out / "grid.jsonl"
    done = {(r["model"], tuple(r["size"]), r["strategy_name"], r["hardware"])
            for r in read_records(runs, skip_bad=True)}  # fmt: skip
    prov = provenance()
    todo = [(m, z, s) for m in GRID_MODELS for z in GRID_SIZES for s in GRID_STRATEGIES]
    for model, size, name in tqdm(todo, desc="video projection grid", unit="point"):
        for hw in GRID_PROFILES:
            if (model, size, name, hw) in done:
                continue
            p = Point(name, "", model, size, GRID_STEPS, GRID_DEVICES, 1, name, hw, "latency_s")
            row = project_point(p, workloads)
            append_record(runs, {"model": model, "size": list(size), "strategy_name": name,
                                 "hardware": hw, "projection": row, "provenance": prov})  # fmt: skip
    write_grid(read_records(runs, skip_bad=True), out / "grid.md")


def write_grid(records: list[dict], path: Path) -> None:
    lines = [
        f"Projected latency of one video (`patchpar project`, bf16, {GRID_STEPS} steps, CFG batch 2 "
        f"on every device, {GRID_DEVICES} devices, frames layout, decode on one device) and "
        "speedup over one device of the same profile; stale strategies with their default "
        "warm-up (DistriFusion and PCPP: 4 steps).",
        "",
        "| model | size | strategy | "
        + " | ".join(f"{h} s (speedup)" for h in GRID_PROFILES)
        + " | exposed comm s ("
        + GRID_PROFILES[0]
        + ") |",
        "|---|---|---|" + "---|" * (len(GRID_PROFILES) + 1),
    ]
    by = {(r["model"], tuple(r["size"]), r["strategy_name"], r["hardware"]): r["projection"]
          for r in records}  # fmt: skip
    for m in GRID_MODELS:
        for z in GRID_SIZES:
            for s in GRID_STRATEGIES:
                cells = [by.get((m, z, s, h)) for h in GRID_PROFILES]
                if all(c is None for c in cells):
                    continue
                txt = ["-" if c is None else f"{c['latency_s']:.1f} ({c['speedup']:.2f}x)"
                       for c in cells]  # fmt: skip
                comm = "-" if cells[0] is None else f"{cells[0]['exposed_comm_s']:.1f}"
                lines.append(f"| {m} | {z[0]}x{z[1]}x{z[2]} | {s} | " + " | ".join(txt)
                             + f" | {comm} |")  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def measured_call_s(p: Point) -> float:
    """The median seconds per denoiser call of the point's committed TPU v5e records."""
    file, _ = p.measured
    size = "x".join(map(str, p.size))
    recs = [
        r
        for r in read_records(V5E / file, skip_bad=True)
        if r.get("model") == p.model and r.get("resolution") == size and r.get("status") == "ok"
    ]
    if not recs:
        raise SystemExit(f"{V5E / file}: no record of {p.model} at {size}")
    return statistics.median(r.get("call_s_median", r.get("unet_call_s_median")) for r in recs)


def project_point(p: Point, workloads: Path) -> dict:
    h, w, f = p.size
    config = ProjectConfig(
        model=AbstractModel(name=p.model),
        mesh=DecodeMesh(devices=p.devices, cfg=p.cfg),
        strategy=StrategyConfig(name=p.strategy, **p.options),
        cache=CacheConfig(),
        resolution=h,
        width=w,
        frames=f,
        steps=p.steps,
        hardware=p.hardware,
        workloads=workloads,
    )
    (row,) = run_project(config, log=lambda m: tqdm.write(f"  {m}"))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="records folder")
    ap.add_argument("--workloads", type=Path, default=None, help="workload cache")
    ap.add_argument("--table-only", action="store_true", help="only rewrite the table")
    ap.add_argument("--only", default="", help="only the points whose name holds this text")
    ap.add_argument("--grid", action="store_true", help="every strategy at full size instead")
    args = ap.parse_args(argv)
    if args.grid:
        grid(args.out, args.workloads or args.out / "workloads.jsonl")
        return 0
    runs = args.out / "runs.jsonl"
    if not args.table_only:
        done = {r["point"] for r in read_records(runs, skip_bad=True)}
        prov = provenance()
        for p in tqdm(POINTS, desc="video projection", unit="point"):
            if p.name in done or args.only not in p.name:
                continue
            tqdm.write(p.name)
            row = project_point(p, args.workloads or args.out / "workloads.jsonl")
            if p.figure == "call_s":  # one call of the one-device program, no encode/decode
                ours = row["compute_s"] / p.steps
                theirs = measured_call_s(p)
            elif p.figure == "speedup":
                ours, theirs = row["speedup"], p.published
            else:
                ours, theirs = row["latency_s"], p.published
            append_record(runs, {
                "point": p.name, "source": p.source, "note": p.note, "model": p.model,
                "size": list(p.size), "steps": p.steps, "devices": p.devices, "cfg": p.cfg,
                "strategy": row["strategy"], "hardware": p.hardware, "figure": p.figure,
                "reference": theirs, "projected": ours, "error": ours / theirs - 1,
                "projection": row, "provenance": prov,
            })  # fmt: skip
    write_table(read_records(runs, skip_bad=True), args.out / "table.md")
    return 0


def write_table(records: list[dict], path: Path) -> None:
    order = {p.name: i for i, p in enumerate(POINTS)}
    records = sorted(records, key=lambda r: order.get(r["point"], len(order)))
    unit = {"latency_s": "s", "speedup": "x", "call_s": "s per call"}
    lines = [
        "Projected (`patchpar project`, bf16, decode on one device) beside published and measured "
        "figures; error = projected / reference - 1. No constant fitted on these points.",
        "",
        "| point | model as projected | size | steps | devices (cfg) | strategy | profile | "
        "reference | projected | error | compute s | exposed comm s | decode s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        pr, u = r["projection"], unit[r["figure"]]
        lines.append(
            f"| {r['point']} | {r['model']} | {'x'.join(map(str, r['size']))} | {r['steps']} | "
            f"{r['devices']} ({r['cfg']}) | {r['strategy']} | {r['hardware']} | "
            f"{r['reference']:.3g} {u} | {r['projected']:.3g} {u} | {100 * r['error']:+.0f}% | "
            f"{pr['compute_s']:.1f} | {pr['exposed_comm_s']:.1f} | {pr['decode_s']:.1f} | "
            f"{r['note']} |"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
