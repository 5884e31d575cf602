"""xDiT's PixArt-α latencies (20 steps, 1024/2048/4096 px, 1 GPU and 8 x A100 NVLink / 4 x A100
PCIe per method) against patchpar's projection of the same runs. No constant is fitted here:
the a100-sxm compute constants are the ones experiments/latency_paper.py fitted on DistriFusion's
SDXL points (patchpar/hardware/a100-sxm.yaml); every row is a check, its error printed.

    .venv/bin/python experiments/latency_xdit.py                 # -> runs/latency_xdit/
    .venv/bin/python experiments/latency_xdit.py --out results/latency_xdit

1. Workloads: PixArt-α XL (bf16, abstract weights, 120 T5 tokens, the CFG pair in the batch on
   every device) lowered on this CPU under single, tensor, distrifusion, ulysses and ring on 8
   and 4 devices; FLOPs and every collective per device, cached in <out>/workloads.jsonl
   (resumable; about 10-40 s each).
2. Check: each published latency (../shared/ANCHORS.md, xDiT's legacy latency figure; which
   source is said beside each row) projected on a100-sxm (NVLink) or a100-pcie, with its error:
   <out>/xdit.jsonl and <out>/xdit.md. PipeFusion rows are listed and left unprojected (not built).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = "pixart-alpha"
STEPS = 20
RESOLUTIONS = (1024, 2048, 4096)
SOURCE = "xDiT legacy assets/latency-*.png, as read in ANCHORS.md"
# xDiT's DistriFusion and PipeFusion run one synchronous warm-up step (its --warmup_steps 1)
STRATEGIES = {
    "tensor": ("tensor", {}),
    "distrifusion": ("distrifusion", {"warmup_steps": 1}),
    "ulysses": ("ulysses", {}),
    "ring": ("ring", {}),
}
# (setup, method, resolution) -> published seconds; setup = (profile, GPUs)
ONE_GPU = {1024: 2.09, 2048: 16.2, 4096: 183.6}
PUBLISHED = {
    ("8xA100 NVLink", "tensor"): (1.22, 7.07, 36.33),
    ("8xA100 NVLink", "pipefusion"): (0.97, 4.06, 45.0),
    ("8xA100 NVLink", "distrifusion"): (0.77, 2.48, 25.24),
    ("8xA100 NVLink", "ulysses"): (1.10, 2.46, 23.31),
    ("8xA100 NVLink", "ring"): (2.08, 4.47, 27.41),
    ("4xA100 PCIe", "tensor"): (4.92, 19.45, 105.7),
    ("4xA100 PCIe", "pipefusion"): (0.866, 5.37, 60.15),
    ("4xA100 PCIe", "distrifusion"): (2.33, 9.62, 68.35),
    ("4xA100 PCIe", "ulysses"): (1.74, 7.93, 59.01),
    ("4xA100 PCIe", "ring"): (2.63, 11.05, 65.85),
}
SETUPS = {"8xA100 NVLink": ("a100-sxm", 8), "4xA100 PCIe": ("a100-pcie", 4)}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "latency_xdit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import numpy as np
    from tqdm import tqdm

    from patchpar import hardware
    from patchpar.lab.config import build_plan
    from patchpar.lab.results import provenance
    from patchpar.measure.projection import WorkloadCache, project

    args = parse(argv)
    prov = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = WorkloadCache(args.out / "workloads.jsonl")
    points = [("single", {}, r, 1) for r in RESOLUTIONS]
    points += [
        (*STRATEGIES[m], r, SETUPS[setup][1])
        for (setup, m) in PUBLISHED
        if m in STRATEGIES
        for r in RESOLUTIONS
    ]
    t0 = time.time()
    wl = {}
    for name, opts, r, n in tqdm(points, desc="workloads", unit="point"):
        wl[(name, r, n)] = cache.get(MODEL, r, build_plan(name, opts, n, 1), 1, "bfloat16")
    print(f"workloads: {len(wl)} ({time.time() - t0:.0f} s)")

    sxm = hardware.load("a100-sxm")
    # a100-pcie borrows a100-sxm's fitted compute constants (its `compute: borrow`)
    profiles = {"a100-sxm": sxm, "a100-pcie": hardware.load("a100-pcie")}
    rows = []
    for r in RESOLUTIONS:
        single = wl[("single", r, 1)]
        p = project(single, single, sxm, STEPS)
        rows.append(_row("1 GPU", "single", r, 1, ONE_GPU[r], p, prov))
    for (setup, method), published in PUBLISHED.items():
        profile, n = SETUPS[setup]
        for r, s in zip(RESOLUTIONS, published, strict=True):
            if method not in STRATEGIES:
                rows.append(_row(setup, method, r, n, s, None, prov))
                continue
            name = STRATEGIES[method][0]
            p = project(wl[(name, r, n)], wl[("single", r, 1)], profiles[profile], STEPS)
            rows.append(_row(setup, method, r, n, s, p, prov))
    tmp = args.out / "xdit.jsonl.tmp"
    tmp.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in rows))
    tmp.replace(args.out / "xdit.jsonl")
    errors = [abs(x["error"]) for x in rows if x["error"] is not None]
    summary = {
        "points": len(errors),
        "median_abs_error": float(np.median(errors)),
        "max_abs_error": float(np.max(errors)),
    }
    text = xdit_md(rows, summary, sxm)
    (args.out / "xdit.md").write_text(text)
    print(text)
    return 0


def _row(setup, method, r, n, published, p, prov) -> dict:
    return {
        "setup": setup,
        "method": method,
        "resolution": r,
        "gpus": n,
        "published_s": published,
        "source": SOURCE,
        "projected_s": None if p is None else p.latency_s,
        "error": None if p is None else p.latency_s / published - 1.0,
        "compute_s": None if p is None else p.compute_s,
        "exposed_comm_s": None if p is None else p.exposed_comm_s,
        "other_s": None if p is None else p.other_s,
        "hardware": None if p is None else p.hardware,
        "model": MODEL,
        "steps": STEPS,
        "provenance": prov,
    }


def xdit_md(rows, summary, sxm) -> str:
    lines = [
        "# PixArt-α latency: xDiT's published figures vs patchpar's projection",
        "",
        f"`python experiments/latency_xdit.py`; {STEPS} steps, bf16, CFG pair on every device, "
        f"120 T5 tokens. Compute constants as fitted on DistriFusion's SDXL points "
        f"(flop_efficiency {sxm.flop_efficiency:.4f}, call_overhead_s "
        f"{sxm.call_overhead_s * 1e3:.3f} ms); nothing is fitted on these rows. Published: "
        f"{SOURCE}.",
        "",
        "| setup | method | px | GPUs | published s | projected s | error | compute s "
        "| exposed comm s | T5 + VAE s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        if x["projected_s"] is None:
            lines.append(
                f"| {x['setup']} | {x['method']} | {x['resolution']} | {x['gpus']} | "
                f"{x['published_s']:.2f} | (not built) | | | | |"
            )
            continue
        lines.append(
            f"| {x['setup']} | {x['method']} | {x['resolution']} | {x['gpus']} | "
            f"{x['published_s']:.2f} | {x['projected_s']:.2f} | {x['error'] * 100:+.1f}% | "
            f"{x['compute_s']:.2f} | {x['exposed_comm_s']:.3f} | {x['other_s']:.3f} |"
        )
    lines += [
        "",
        f"{summary['points']} points: median absolute error "
        f"{summary['median_abs_error'] * 100:.1f}%, largest {summary['max_abs_error'] * 100:.1f}%.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
