"""Compressed exchange at full size: bytes per device (from the compiled programs) and projected
latency of DistriFusion against its compressed variants and CompactFusion's synchronous mode,
for SDXL and PixArt-α on 4 devices (CompactFusion's setting), over NVLink, PCIe and 25 / 10 Gb
Ethernet. Nothing is fitted here: compute constants are a100-sxm's (borrowed by every profile,
as each profile file says); CompactFusion's published latencies (FLUX.1, 28 steps, 4 GPUs; a
model patchpar does not run) are printed beside for scale, not as checks.

    .venv/bin/python experiments/compress_projection.py                        # -> runs/compress_projection/
    .venv/bin/python experiments/compress_projection.py --out results/compress_projection

1. Workloads: each model (bf16, abstract weights, the CFG pair on every device) lowered on this
   CPU under single, sync_patch, distrifusion, distrifusion with int2 / sign1 residuals (stale),
   and compact int2 / sign1 (fresh), all with one exact warm-up step (warmup_steps 1, as xDiT's
   and CompactFusion's runs); cached in <out>/workloads.jsonl (resumable).
2. Bytes per device per step (warm-up and steady) and per image: projection.md.
3. Latency on h100-sxm, l20, l20-25gbe, l20-10gbe: projection.jsonl and projection.md. The
   codecs' work is priced as the stale buffers' HBM traffic (their bases are stale buffers) plus
   their FLOPs in the compiled program's cost analysis.
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

DEVICES = 4
STEPS = 28
MODELS = {  # model -> (resolutions, codec of the compressed points: a UNet's halos too)
    "sdxl": ((1024, 2048, 3840), {"int2": "kv=int2,halo=int2", "sign1": "kv=sign1,halo=sign1"}),
    "pixart-alpha": ((1024, 2048), {"int2": "int2", "sign1": "sign1"}),
}
METHODS = (
    "sync_patch",
    "distrifusion",
    "stale int2",
    "stale sign1",
    "compact int2",
    "compact sign1",
)
PROFILES = ("h100-sxm", "l20", "l20-25gbe", "l20-10gbe")
# CompactFusion's published seconds (FLUX.1-dev 1024^2, 28 steps, 4 GPUs; ANCHORS.md)
PUBLISHED = {
    "4xL20 PCIe": {
        "1 GPU": 20.26,
        "distrifusion": 6.86,
        "compact-1bit": 6.86,
        "compact-2bit": 6.70,
    },
    "4xH20 NVLink": {
        "1 GPU": 23.16,
        "distrifusion": 8.05,
        "compact-1bit": 7.46,
        "compact-2bit": 7.57,
    },
    "simulated Ethernet": {
        "1 GPU": 28.06,
        "distrifusion": 139.73,
        "compact-1bit": 20.91,
        "compact-2bit": 27.48,
    },
}


def strategy(method: str, codecs: dict) -> tuple[str, dict]:
    if method == "single":
        return "single", {}
    if method == "sync_patch":
        return "sync_patch", {}
    if method == "distrifusion":
        return "distrifusion", {"warmup_steps": 1}
    kind, codec = method.split()
    name = "distrifusion" if kind == "stale" else "compact"
    return name, {"warmup_steps": 1, "codec": codecs[codec]}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "compress_projection")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from tqdm import tqdm

    from patchpar import hardware
    from patchpar.lab.config import build_plan
    from patchpar.lab.results import provenance
    from patchpar.measure.projection import project, warmup_phase_steps
    from patchpar.measure.workload import WorkloadCache

    args = parse(argv)
    prov = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = WorkloadCache(args.out / "workloads.jsonl")
    points = [
        (model, r, method)
        for model, (resolutions, _) in MODELS.items()
        for r in resolutions
        for method in ("single", *METHODS)
    ]
    t0 = time.time()
    wl = {}
    for model, r, method in tqdm(points, desc="workloads", unit="point"):
        name, opts = strategy(method, MODELS[model][1])
        n = 1 if method == "single" else DEVICES
        wl[(model, r, method)] = cache.get(model, r, build_plan(name, opts, n, 1), 1, "bfloat16")
    print(f"workloads: {len(wl)} ({time.time() - t0:.0f} s)")

    rows = []
    for (model, r, method), w in wl.items():
        if method == "single":
            continue
        per_step = {ph: received(w.phases[ph]["collectives"]) for ph in ("warmup", "steady")}
        n_warm = warmup_phase_steps(w, STEPS)
        total = n_warm * per_step["warmup"] + (STEPS - n_warm) * per_step["steady"]
        row = {
            "model": model,
            "resolution": r,
            "method": method,
            "strategy": w.strategy,
            "devices": w.devices,
            "steps": STEPS,
            "warmup_bytes_per_device": per_step["warmup"],
            "steady_bytes_per_device": per_step["steady"],
            "bytes_per_device_total": total,
            "stale_bytes_per_device": w.stale_bytes_per_device,
            "latency_s": {},
            "speedup": {},
            "provenance": prov,
        }
        for hw_name in PROFILES:
            p = project(w, wl[(model, r, "single")], hardware.load(hw_name), STEPS)
            row["latency_s"][hw_name] = p.latency_s
            row["speedup"][hw_name] = p.speedup
            row.setdefault("single_latency_s", {})[hw_name] = p.single_latency_s
        rows.append(row)
    tmp = args.out / "projection.jsonl.tmp"
    tmp.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in rows))
    tmp.replace(args.out / "projection.jsonl")
    text = report(rows)
    (args.out / "projection.md").write_text(text)
    print(text)
    return 0


def received(collectives: list[dict]) -> int:
    """Bytes received in one step: each collective's busiest device, summed (the projection's
    own reading of the workload; an edge device receives a halo from one side only)."""
    return sum(g["received_bytes"] for g in collectives)


def report(rows) -> str:
    gib = 2**30
    lines = [
        f"# Compressed exchange at full size ({DEVICES} devices, {STEPS} steps, bf16, one exact "
        "warm-up step)",
        "",
        "`python experiments/compress_projection.py`. Bytes: received per device, each "
        "collective's busiest device summed, from the compiled programs. Latency: projected seconds per image (speedup over one device); "
        "compute constants a100-sxm's, borrowed.",
        "",
        "## Bytes per device",
        "",
        "| model | px | method | warm-up GiB/step | steady GiB/step | GiB/image | vs distrifusion |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {(x["model"], x["resolution"]): x for x in rows if x["method"] == "distrifusion"}
    for x in rows:
        ref = base[(x["model"], x["resolution"])]["bytes_per_device_total"]
        lines.append(
            f"| {x['model']} | {x['resolution']} | {x['method']} | "
            f"{x['warmup_bytes_per_device'] / gib:.3f} | {x['steady_bytes_per_device'] / gib:.4f} | "
            f"{x['bytes_per_device_total'] / gib:.2f} | {x['bytes_per_device_total'] / ref:.1%} |"
        )
    lines += [
        "",
        "## Projected latency, seconds (speedup)",
        "",
        "| model | px | hardware | 1 device | " + " | ".join(METHODS) + " |",
        "|---|---|---|---|" + "---|" * len(METHODS),
    ]
    by: dict = {}
    for x in rows:
        by.setdefault((x["model"], x["resolution"]), {})[x["method"]] = x
    for (model, r), methods in by.items():
        for hw in PROFILES:
            one = next(iter(methods.values()))["single_latency_s"][hw]
            cells = " | ".join(
                f"{methods[m]['latency_s'][hw]:.2f} ({methods[m]['speedup'][hw]:.1f}x)"
                for m in METHODS
            )
            lines.append(f"| {model} | {r} | {hw} | {one:.2f} | {cells} |")
    lines += [
        "",
        "CompactFusion's published seconds (FLUX.1-dev 1024², 28 steps, 4 GPUs; another model, "
        "for scale only):",
        "",
        "| setup | " + " | ".join(next(iter(PUBLISHED.values()))) + " |",
        "|---|" + "---|" * len(next(iter(PUBLISHED.values()))),
    ]
    for setup, vals in PUBLISHED.items():
        lines.append(f"| {setup} | " + " | ".join(f"{v:.2f}" for v in vals.values()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
