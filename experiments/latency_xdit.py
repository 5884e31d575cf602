"""xDiT's PixArt-α latencies (20 steps, 1024/2048/4096 px, 1 GPU and 8 x A100 NVLink / 4 x A100
PCIe / 8 x L20 PCIe per method) against patchpar's projection of the same runs. No constant is
fitted here: the a100-sxm compute constants are the ones experiments/latency_paper.py fitted on
DistriFusion's SDXL points (patchpar/hardware/a100-sxm.yaml; a100-pcie and l20 borrow them);
every row is a check, its error printed.

    .venv/bin/python experiments/latency_xdit.py                 # -> runs/latency_xdit/
    .venv/bin/python experiments/latency_xdit.py --out results/latency_xdit

1. Workloads: PixArt-α XL (bf16, abstract weights, 120 T5 tokens, the CFG pair in the batch on
   every device) lowered on this CPU under single, tensor, distrifusion, ulysses, ring and
   pipefusion (M = S patches, one full warm-up pass) on 8 and 4 devices; FLOPs and every
   collective per device, cached in <out>/workloads.jsonl (resumable; about 10-60 s each).
2. Check: each published latency (../shared/ANCHORS.md, xDiT's legacy latency figure; which
   source is said beside each row) projected on a100-sxm (NVLink), a100-pcie or l20, with its
   error: <out>/xdit.jsonl and <out>/xdit.md.
3. Predictions, the same workloads on 8 devices of h100-sxm, h200-sxm, rtx4090 and tpu-v5e:
   <out>/predictions.jsonl and <out>/predictions.md.
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
    "pipefusion": ("pipefusion", {"warmup_steps": 1}),
}
# one GPU's published seconds per chip
ONE_GPU = {"A100": (2.09, 16.2, 183.6), "L20": (3.34, 26.43, 306.6)}
# (setup, method) -> published seconds at RESOLUTIONS (None: xDiT reports out of memory)
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
    ("8xL20 PCIe", "tensor"): (8.42, 14.3, 82.49),
    ("8xL20 PCIe", "pipefusion"): (1.35, 6.35, 71.13),
    ("8xL20 PCIe", "distrifusion"): (4.43, 6.32, None),
    ("8xL20 PCIe", "ulysses"): (5.99, 19.03, 116.9),
    ("8xL20 PCIe", "ring"): (1.74, 6.62, 49.87),
}
SETUPS = {
    "8xA100 NVLink": ("a100-sxm", 8),
    "4xA100 PCIe": ("a100-pcie", 4),
    "8xL20 PCIe": ("l20", 8),
}
ONE_GPU_SETUP = {"A100": "a100-sxm", "L20": "l20"}  # the profile each one-GPU row is projected on
PREDICT_ON = ("h100-sxm", "h200-sxm", "rtx4090", "tpu-v5e")  # 8 devices each


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
    from patchpar.measure.projection import project
    from patchpar.measure.workload import WorkloadCache

    args = parse(argv)
    prov = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = WorkloadCache(args.out / "workloads.jsonl")
    points = [("single", {}, r, 1) for r in RESOLUTIONS]
    points += [
        (*STRATEGIES[m], r, n)
        for n in sorted({n for _, n in SETUPS.values()})
        for m in STRATEGIES
        for r in RESOLUTIONS
    ]
    t0 = time.time()
    wl = {}
    for name, opts, r, n in tqdm(points, desc="workloads", unit="point"):
        wl[(name, r, n)] = cache.get(MODEL, r, build_plan(name, opts, n, 1), 1, "bfloat16")
    print(f"workloads: {len(wl)} ({time.time() - t0:.0f} s)")

    sxm = hardware.load("a100-sxm")
    # a100-pcie and l20 borrow a100-sxm's fitted compute constants (their `compute: borrow`)
    profiles = {name: hardware.load(name) for name, _ in SETUPS.values()}
    rows = []
    for chip, published in ONE_GPU.items():
        for r, s in zip(RESOLUTIONS, published, strict=True):
            single = wl[("single", r, 1)]
            p = project(single, single, profiles[ONE_GPU_SETUP[chip]], STEPS)
            rows.append(_row(f"1 {chip}", "single", r, 1, s, p, prov))
    for (setup, method), published in PUBLISHED.items():
        profile, n = SETUPS[setup]
        for r, s in zip(RESOLUTIONS, published, strict=True):
            p = project(
                wl[(STRATEGIES[method][0], r, n)], wl[("single", r, 1)], profiles[profile], STEPS
            )
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
    for method in STRATEGIES:
        mine = [abs(x["error"]) for x in rows if x["error"] is not None and x["method"] == method]
        summary[f"median_abs_error_{method}"] = float(np.median(mine))
    text = xdit_md(rows, summary, sxm)
    (args.out / "xdit.md").write_text(text)
    print(text)

    preds = []
    for hw_name in PREDICT_ON:
        hw = hardware.load(hw_name)
        for r in RESOLUTIONS:
            for method in ("single", *STRATEGIES):
                n = 1 if method == "single" else 8
                name = "single" if method == "single" else STRATEGIES[method][0]
                p = project(wl[(name, r, n)], wl[("single", r, 1)], hw, STEPS)
                preds.append(
                    {
                        "hardware": hw_name,
                        "method": method,
                        "resolution": r,
                        "gpus": n,
                        "latency_s": p.latency_s,
                        "speedup": p.speedup,
                        "compute_s": p.compute_s,
                        "exposed_comm_s": p.exposed_comm_s,
                        "model": MODEL,
                        "steps": STEPS,
                        "provenance": prov,
                    }
                )
    tmp = args.out / "predictions.jsonl.tmp"
    tmp.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in preds))
    tmp.replace(args.out / "predictions.jsonl")
    text = predictions_md(preds)
    (args.out / "predictions.md").write_text(text)
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
        "error": None if p is None or published is None else p.latency_s / published - 1.0,
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
        published = "OOM" if x["published_s"] is None else f"{x['published_s']:.2f}"
        error = "" if x["error"] is None else f"{x['error'] * 100:+.1f}%"
        lines.append(
            f"| {x['setup']} | {x['method']} | {x['resolution']} | {x['gpus']} | "
            f"{published} | {x['projected_s']:.2f} | {error} | "
            f"{x['compute_s']:.2f} | {x['exposed_comm_s']:.3f} | {x['other_s']:.3f} |"
        )
    per_method = ", ".join(f"{m} {summary[f'median_abs_error_{m}'] * 100:.1f}%" for m in STRATEGIES)
    lines += [
        "",
        f"{summary['points']} points: median absolute error "
        f"{summary['median_abs_error'] * 100:.1f}%, largest {summary['max_abs_error'] * 100:.1f}%. "
        f"Median by method: {per_method}.",
        "",
    ]
    return "\n".join(lines)


def predictions_md(preds) -> str:
    lines = [
        f"# PixArt-α projected on other hardware ({STEPS} steps, bf16, CFG pair on every device)",
        "",
        "`python experiments/latency_xdit.py`; 8 devices per method, seconds (speedup over one "
        "device of the same kind). Compute constants: a100-sxm's fitted ones, borrowed.",
        "",
        "| hardware | px | 1 device | " + " | ".join(STRATEGIES) + " |",
        "|---|---|---|" + "---|" * len(STRATEGIES),
    ]
    key = {}
    for p in preds:
        key.setdefault((p["hardware"], p["resolution"]), {})[p["method"]] = p
    for (hw, r), by in key.items():
        cells = " | ".join(
            f"{by[m]['latency_s']:.2f} ({by[m]['speedup']:.1f}x)" for m in STRATEGIES
        )
        lines.append(f"| {hw} | {r} | {by['single']['latency_s']:.2f} | {cells} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
