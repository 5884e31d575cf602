"""Projected latency of AsyncDiff at full size beside DistriFusion: `patchpar project` on 2 and 4
A100 SXM devices, bf16, for SD 2.1 at 768² and SDXL at 1024² (50-step DDIM: AsyncDiff's own
tables), PixArt-α (20 steps) and FLUX.1-dev (28 steps) at 1024². AsyncDiff warms up about a fifth of the steps exactly (the
released code's examples: 9 of 50); DistriFusion its default (FLUX.1 one synchronous step,
xDiT's). Latencies without the VAE decode (DistriFusion's and AsyncDiff's published latencies
time the denoising) and with it on one device. A model, not a measurement: FLOPs and
collectives of each phase's program lowered here with abstract weights, priced by the
profile's fitted compute curve. Stride 2 (the paper's stride denoising: S components on S + 1
devices, a round every other step) on 3 and 4 devices.

    .venv/bin/python experiments/asyncdiff_projection.py                    # -> runs/asyncdiff_projection/
    .venv/bin/python experiments/asyncdiff_projection.py --out results/asyncdiff_projection
    .venv/bin/python experiments/asyncdiff_projection.py --models pixart-alpha --devices 2
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# model -> (resolution, steps, asyncdiff warm-up steps, DistriFusion options)
POINTS = {
    "sd21": (768, 50, 9, {}),
    "sdxl": (1024, 50, 9, {}),
    "pixart-alpha": (1024, 20, 4, {}),
    "flux-dev": (1024, 28, 5, {"warmup_steps": 1}),
}


def main() -> None:
    from patchpar.lab.project import ProjectConfig, run_project

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/asyncdiff_projection"))
    ap.add_argument("--models", nargs="+", default=list(POINTS), choices=list(POINTS))
    ap.add_argument("--hardware", default="a100-sxm")
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--stride2-devices", type=int, nargs="*", default=[3, 4])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        resolution, steps, warmup, df_options = POINTS[model]
        for devices in sorted(set(args.devices) | set(args.stride2_devices)):
            points = []
            if devices in args.devices:
                points += [("asyncdiff", {"warmup_steps": warmup}), ("distrifusion", df_options)]
            if devices in args.stride2_devices:
                points.append(("asyncdiff", {"warmup_steps": warmup, "stride": 2}))
            for strategy, options in points:
                print(f"{model}: {strategy} on {devices}", flush=True)
                config = ProjectConfig.from_flags(
                    model=model, resolution=resolution, steps=steps, strategy=strategy,
                    devices=devices, hardware=args.hardware,
                    workloads=args.out / "workloads.jsonl", **options,
                )  # fmt: skip
                (r,) = run_project(config, log=lambda m: print("  " + m, flush=True))
                rows.append(r)
    lines = [
        f"{args.hardware}, bf16 (projected; `experiments/asyncdiff_projection.py`)",
        "",
        "| model | resolution | steps | strategy | devices | 1 device s | latency s | speedup | "
        "1 device s, with decode | latency s, with decode | speedup, with decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one = r["single_latency_s"] - r["decode_one_device_s"]  # one device, no decode
        lines.append(
            f"| {r['model']} | {r['resolution']} | {r['steps']} | {r['strategy']} | {r['devices']} | "
            f"{one:.2f} | {r['latency_no_decode_s']:.2f} | {one / r['latency_no_decode_s']:.2f}x | "
            f"{r['single_latency_s']:.2f} | {r['latency_s']:.2f} | {r['speedup']:.2f}x |"
        )
    (args.out / "projection.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
