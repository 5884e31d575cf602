"""MMDiTs' published latencies (FLUX.1-dev, SD3-medium) against patchpar's projection of the
same runs. No constant is fitted here: the compute constants are the ones
experiments/latency_paper.py fitted on DistriFusion's SDXL points (a100-sxm; h100-sxm and l20
take theirs as their profiles say); every row is a check, its error printed.

    .venv/bin/python experiments/latency_mmdit.py --suite flux   # -> runs/latency_flux/
    .venv/bin/python experiments/latency_mmdit.py --suite flux --out results/flux/latency
    .venv/bin/python experiments/latency_mmdit.py --suite sd3 --out results/sd3/latency

1. Workloads: the suite's model (bf16, abstract weights) lowered on this CPU under each
   method's plan; FLOPs and every collective per device, cached in <out>/workloads.jsonl
   (resumable).
   - flux: FLUX.1-dev 1024², 28 steps, 512 T5 tokens, one model call per step (the guidance
     scale is an input), single, ulysses, ring, distrifusion, pipefusion and compact (2-bit and
     1-bit K/V) on 4 devices; stale methods with one synchronous warm-up step (xDiT's
     --warmup_steps 1).
   - sd3: SD3-medium 1024², 20 steps, 77 + 256 text tokens, CFG; xDiT's best configuration per
     GPU count: the CFG halves split (cfg=2) on 2, with PipeFusion over 2 and 4 stages on 4
     and 8.
2. Checks (../shared/ANCHORS.md and each source):
   - flux: xDiT's 4 x H100 (compiled; docs/performance/flux.md) on h100-sxm; CompactFusion's
     4 x L20 PCIe (its repo's latency CSVs) on l20; diffusers' context parallelism on 4 x L20
     (ms per step, its distributed-inference docs) on l20, compared per denoising step (the
     encoders and decode left out).
   - sd3: xDiT's 8 x A100 NVLink chart (docs/performance/sd3.md, eager PyTorch bars; its 8 x
     L40 chart has no profile here) on a100-sxm.
   -> <out>/<suite>.jsonl, <out>/<suite>.md.
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

XDIT = "xDiT docs/performance/flux.md (compiled)"
COMPACT = "CompactFusion compact_plot/latency_data (L20 PCIe)"
DIFFUSERS = "diffusers distributed-inference docs (ms per step)"
XDIT_SD3 = "xDiT docs/performance/sd3.md, A100-SD3.png (eager)"
# Per suite: the model, resolution, steps, text note, the methods (name: (strategy, options,
# devices, cfg)) and the published rows (setup, hardware profile, method, published, unit,
# source): unit "s" = a whole generation, "ms/step" = one denoising step.
SUITES = {
    "flux": {
        "model": "flux-dev",
        "resolution": 1024,
        "steps": 28,
        "text": "512 T5 tokens, one model call per step (guidance as an input); stale methods "
        "with one synchronous warm-up step",
        "methods": {
            "single": ("single", {}, 1, 1),
            "ulysses": ("ulysses", {}, 4, 1),
            "ring": ("ring", {}, 4, 1),
            "distrifusion": ("distrifusion", {"warmup_steps": 1}, 4, 1),
            "pipefusion": ("pipefusion", {"warmup_steps": 1}, 4, 1),
            "compact-2bit": ("compact", {"codec": "int2"}, 4, 1),
            "compact-1bit": ("compact", {"codec": "sign1"}, 4, 1),
        },
        "published": [
            ("1 x H100", "h100-sxm", "single", 4.30, "s", XDIT),
            ("4 x H100", "h100-sxm", "ulysses", 1.63, "s", XDIT),
            ("4 x H100", "h100-sxm", "ring", 1.98, "s", XDIT),
            ("1 x L20", "l20", "single", 20.26, "s", COMPACT),
            ("4 x L20 PCIe", "l20", "distrifusion", 6.86, "s", COMPACT),
            ("4 x L20 PCIe", "l20", "ulysses", 6.70, "s", COMPACT),
            ("4 x L20 PCIe", "l20", "ring", 7.54, "s", COMPACT),
            ("4 x L20 PCIe", "l20", "pipefusion", 9.07, "s", COMPACT),
            ("4 x L20 PCIe", "l20", "compact-1bit", 6.86, "s", COMPACT),
            ("4 x L20 PCIe", "l20", "compact-2bit", 6.70, "s", COMPACT),
            ("4 x L20", "l20", "ulysses", 281.0, "ms/step", DIFFUSERS),
            ("4 x L20", "l20", "ring", 351.0, "ms/step", DIFFUSERS),
        ],
    },
    "sd3": {
        "model": "sd3-medium",
        "resolution": 1024,
        "steps": 20,
        "text": "77 CLIP + 256 T5 tokens, classifier-free guidance (two halves); PipeFusion "
        "with one exact warm-up pass (xDiT's default)",
        "methods": {
            "single": ("single", {}, 1, 1),
            "cfg=2": ("sync_patch", {}, 2, 2),  # one patch: the guidance halves split
            "cfg=2, pipefusion=2": ("pipefusion", {"warmup_steps": 1}, 4, 2),
            "cfg=2, pipefusion=4": ("pipefusion", {"warmup_steps": 1}, 8, 2),
        },
        "published": [
            ("1 x A100", "a100-sxm", "single", 3.09, "s", XDIT_SD3),
            ("2 x A100 NVLink", "a100-sxm", "cfg=2", 1.73, "s", XDIT_SD3),
            ("4 x A100 NVLink", "a100-sxm", "cfg=2, pipefusion=2", 1.31, "s", XDIT_SD3),
            ("8 x A100 NVLink", "a100-sxm", "cfg=2, pipefusion=4", 0.90, "s", XDIT_SD3),
        ],
    },
}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="flux")
    p.add_argument("--out", type=Path, default=None, help="default runs/latency_<suite>")
    a = p.parse_args(argv)
    a.out = a.out or REPO / "runs" / f"latency_{a.suite}"
    return a


def main(argv=None) -> int:
    import numpy as np
    from tqdm import tqdm

    from patchpar import hardware
    from patchpar.lab.config import build_plan
    from patchpar.lab.results import provenance
    from patchpar.measure.projection import project
    from patchpar.measure.workload import WorkloadCache

    args = parse(argv)
    suite = SUITES[args.suite]
    model, resolution, steps = suite["model"], suite["resolution"], suite["steps"]
    prov = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = WorkloadCache(args.out / "workloads.jsonl")
    t0 = time.time()
    wl = {}
    for method, (name, opts, n, cfg) in tqdm(suite["methods"].items(), desc="workloads",
                                             unit="point"):  # fmt: skip
        wl[method] = cache.get(model, resolution, build_plan(name, opts, n, cfg), 1, "bfloat16")
    print(f"workloads: {len(wl)} ({time.time() - t0:.0f} s)")

    rows = []
    for setup, profile, method, published, unit, source in suite["published"]:
        hw = hardware.load(profile)
        p = project(wl[method], wl["single"], hw, steps)
        per_step_ms = (p.latency_s - p.other_s) / steps * 1e3
        projected = p.latency_s if unit == "s" else per_step_ms
        rows.append(
            {
                "setup": setup,
                "hardware": profile,
                "method": method,
                "strategy": wl[method].strategy,
                "gpus": suite["methods"][method][2],
                "unit": unit,
                "published": published,
                "projected": projected,
                "error": projected / published - 1.0,
                "compute_s": p.compute_s,
                "exposed_comm_s": p.exposed_comm_s,
                "other_s": p.other_s,
                "speedup": p.speedup,
                "source": source,
                "model": model,
                "resolution": resolution,
                "steps": steps,
                "provenance": prov,
            }
        )
    # speedups within one source's setup: its one-GPU row against each multi-GPU row
    singles = {(x["hardware"], x["source"]): x for x in rows if x["method"] == "single"}
    for x in rows:
        base = singles.get((x["hardware"], x["source"]))
        if base is not None and x["method"] != "single":
            x["published_speedup"] = base["published"] / x["published"]
            x["projected_speedup"] = base["projected"] / x["projected"]
            x["speedup_error"] = x["projected_speedup"] / x["published_speedup"] - 1.0
    tmp = args.out / f"{args.suite}.jsonl.tmp"
    tmp.write_text("".join(json.dumps(x, sort_keys=True, default=str) + "\n" for x in rows))
    tmp.replace(args.out / f"{args.suite}.jsonl")
    errors = [abs(x["error"]) for x in rows]
    lines = [
        f"# {model} latency: published figures vs patchpar's projection",
        "",
        f"`python experiments/latency_mmdit.py --suite {args.suite}`; {resolution}², {steps} "
        f"steps, bf16, {suite['text']}. Nothing is fitted on these rows.",
        "",
        "| setup | hardware | method | published | projected | error | speedup published → "
        "projected (error) | compute s | exposed comm s | encoders + VAE s | source |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        unit = x["unit"]
        speedup = (
            f"{x['published_speedup']:.2f}× → {x['projected_speedup']:.2f}× "
            f"({x['speedup_error'] * 100:+.1f}%)"
            if "speedup_error" in x
            else ""
        )
        lines.append(
            f"| {x['setup']} | {x['hardware']} | {x['method']} | {x['published']:g} {unit} | "
            f"{x['projected']:.2f} {unit} | {x['error'] * 100:+.1f}% | {speedup} | "
            f"{x['compute_s']:.2f} | {x['exposed_comm_s']:.3f} | {x['other_s']:.3f} | "
            f"{x['source']} |"
        )
    sp = [abs(x["speedup_error"]) for x in rows if "speedup_error" in x]
    lines += [
        "",
        f"{len(errors)} points: median absolute error {np.median(errors) * 100:.1f}%, "
        f"largest {np.max(errors) * 100:.1f}%. Speedups over the same source's one GPU "
        f"({len(sp)} points): median absolute error {np.median(sp) * 100:.1f}%, largest "
        f"{np.max(sp) * 100:.1f}%.",
        "",
    ]
    text = "\n".join(lines)
    (args.out / f"{args.suite}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
