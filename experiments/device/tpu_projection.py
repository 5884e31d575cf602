"""PixArt-α at 1024² (20 steps, bf16, the CFG pair on every chip) projected on 4 and 8 TPU v5e
chips for every patch and context strategy, with the per-chip compute the chip itself measured
(`shard_timing.py` records in results/tpu_v5e) in place of the fitted curve, and the
communication priced by the tpu-v5e profile (patchpar/hardware/tpu-v5e.yaml, its data-sheet
ICI). No multi-chip run exists to check these against (the lent machine has one chip): they are
predictions; where a strategy's per-chip program was timed with only one kernel, that kernel's
single program is its baseline.

    .venv/bin/python experiments/device/tpu_projection.py     # -> runs/tpu_projection
    .venv/bin/python experiments/device/tpu_projection.py --out results/tpu_v5e/projection

Records: <out>/records.jsonl (one per strategy, chips and kernel, with the projection's split
and the timings file it read); table: <out>/table.md. Workloads (FLOPs and collectives from
PixArt-α's programs lowered here with abstract weights) are cached in <out>/workloads.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MODEL, RESOLUTION, STEPS = "pixart-alpha", 1024, 20
RESULTS = REPO / "results" / "tpu_v5e"
# kernel -> (folders of shard_timing records, the strategies timed there)
TIMINGS = {
    "chunked 256x512": (("shards_chunked",), ("sync_patch", "distrifusion")),
    "splash 256x512": (
        ("shards", "shards_strategies", "shards_distrifusion8"),
        ("sync_patch", "distrifusion", "pcpp", "ulysses", "ring"),
    ),
}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "tpu_projection")
    p.add_argument("--chips", type=int, nargs="+", default=[4, 8])
    return p.parse_args(argv)


def main(argv=None) -> int:
    from patchpar import hardware
    from patchpar.lab.config import build_plan
    from patchpar.lab.project import timed_compute
    from patchpar.lab.results import provenance, read_records
    from patchpar.measure.projection import WorkloadCache, project

    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    hw = hardware.load("tpu-v5e")
    cache = WorkloadCache(a.out / "workloads.jsonl")
    single = cache.get(MODEL, RESOLUTION, build_plan("single", {}, 1, 1), 1, "bfloat16")
    rows = []
    for kernel, (folders, strategies) in TIMINGS.items():
        records = [r for f in folders for r in read_records(RESULTS / f / "records.jsonl")]
        for n in a.chips:
            for name in strategies:
                w = cache.get(MODEL, RESOLUTION, build_plan(name, {}, n, 1), 1, "bfloat16")
                measured = timed_compute(records, hw.name, w)
                p = project(w, single, hw, STEPS, measured=measured)
                rows.append({
                    "model": MODEL, "resolution": RESOLUTION, "steps": STEPS, "chips": n,
                    "hardware": hw.name, "kernel": kernel, "strategy": w.strategy,
                    "timings": [f"results/tpu_v5e/{f}/records.jsonl" for f in folders],
                    "compute_source": p.compute_source, "latency_s": p.latency_s,
                    "single_latency_s": p.single_latency_s, "speedup": p.speedup,
                    "compute_s": p.compute_s, "exposed_comm_s": p.exposed_comm_s,
                    "other_s": p.other_s, "provenance": prov,
                })  # fmt: skip
                print(f"{kernel} {n} chips {name}: {p.latency_s:.3f} s, {p.speedup:.2f}x "
                      f"({p.compute_source})", flush=True)  # fmt: skip
    tmp = a.out / "records.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    tmp.replace(a.out / "records.jsonl")
    (a.out / "table.md").write_text(table(rows))
    print(table(rows))
    return 0


def table(rows) -> str:
    lines = [
        f"PixArt-α {RESOLUTION}², {STEPS} steps, bf16, CFG pair on every chip, on TPU v5e "
        "(profile tpu-v5e): projected seconds per image (T5 and the VAE decode on one chip "
        "included), speedup over one chip of the same kernel and over the fastest one-chip "
        "program measured, and the split",
        "",
        "| kernel | chips | strategy | latency s | speedup | over the fastest chip | compute s | "
        "exposed comm s | T5 + VAE s | compute |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    single = {r["kernel"]: r["single_latency_s"] for r in rows}
    fastest = min(single.values())
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['chips']} | {r['strategy'].split('(')[0]} | "
            f"{r['latency_s']:.3f} | {r['speedup']:.2f}x | {fastest / r['latency_s']:.2f}x | "
            f"{r['compute_s']:.3f} | {r['exposed_comm_s']:.3f} | {r['other_s']:.3f} | "
            f"{r['compute_source']} |"
        )
    lines += ["", "One chip: " + ", ".join(f"{k} {v:.3f} s" for k, v in single.items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
