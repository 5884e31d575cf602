"""Projected latency of the step caches with patch parallelism at full size (issue: reuse
across steps): `patchpar project` with a cache, on each model's usual sampler length, 4 devices
on A100 SXM, DistriFusion (its default warm-up; FLUX.1 with one synchronous step, xDiT's),
beside the uncached run and one device with the same cache. A model, not a measurement:
FLOPs and collectives of each kind of step's program lowered here with abstract weights,
priced by the profile's fitted compute curve.

The first-block cache decides from the data which steps run, so its number of computed steps
is an input here: half the steps (ParaAttention's FLUX.1-dev first-block cache at its
threshold 0.08 took 26.36 s to 17.01 s on an L20, about 55% of the steps' time), stated in
every row. TaylorSeer's steps follow from its schedule (3 warm-up steps, one in 3 after).

    .venv/bin/python experiments/cache_projection.py                       # -> runs/cache_projection/
    .venv/bin/python experiments/cache_projection.py --out results/cache_projection
    .venv/bin/python experiments/cache_projection.py --models sdxl pixart-alpha
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# model -> (steps, strategy options, caches: (label, flags))
POINTS = {
    "sdxl": (50, {}, [("taylorseer", {"cache": "taylorseer", "cache_interval": 3})]),
    "pixart-alpha": (20, {}, [
        ("fbcache, 10 of 20 steps", {"cache": "fbcache", "cache_computed_steps": 10}),
        ("taylorseer", {"cache": "taylorseer", "cache_interval": 3}),
    ]),
    "flux-dev": (28, {"warmup_steps": 1}, [
        ("fbcache, 14 of 28 steps", {"cache": "fbcache", "cache_computed_steps": 14}),
        ("taylorseer", {"cache": "taylorseer", "cache_interval": 3}),
    ]),
}  # fmt: skip


def main() -> None:
    from patchpar.lab.project import ProjectConfig, run_project

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/cache_projection"))
    ap.add_argument("--models", nargs="+", default=list(POINTS), choices=list(POINTS))
    ap.add_argument("--hardware", default="a100-sxm")
    ap.add_argument("--devices", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        steps, options, caches = POINTS[model]
        for label, flags in caches:
            print(f"{model}: {label}", flush=True)
            config = ProjectConfig.from_flags(
                model=model, resolution=1024, steps=steps, strategy="distrifusion",
                devices=args.devices, hardware=args.hardware,
                workloads=args.out / "workloads.jsonl", **options, **flags,
            )  # fmt: skip
            (r,) = run_project(config, log=lambda m: print("  " + m, flush=True))
            rows.append({"label": label, **r})
    lines = [
        f"DistriFusion on {args.devices} x {args.hardware}, 1024², bf16, decode on one device "
        "(projected; `experiments/cache_projection.py`)",
        "",
        "| model | steps | cache | computed steps | 1 device s | 1 device + cache s | "
        f"{args.devices} devices s | {args.devices} devices + cache s | speedup vs 1 device | "
        "vs 1 device + cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['steps']} | {r['label']} | {r['cache_computed_steps']} | "
            f"{r['single_latency_s']:.2f} | {r['single_cached_latency_s']:.2f} | "
            f"{r['latency_s']:.2f} | {r['latency_cached_s']:.2f} | {r['speedup_cached']:.2f}x | "
            f"{r['speedup_vs_single_same_cache']:.2f}x |"
        )
    (args.out / "projection.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
