"""PixArt-α at 1024² (20 steps, bf16, the CFG pair on every chip) projected on 4 and 8 TPU v5e
chips for every patch and context strategy, with the per-chip compute the chip itself measured
(`shard_timing.py` records in results/tpu_v5e) in place of the fitted curve, and the
communication priced by the tpu-v5e profile (patchpar/hardware/tpu-v5e.yaml, its data-sheet
ICI). No multi-chip run exists to check these against (the lent machine has one chip): they are
predictions; where a strategy's per-chip program was timed with only one kernel, that kernel's
single program is its baseline.

    .venv/bin/python experiments/device/tpu_projection.py     # -> runs/tpu_projection
    .venv/bin/python experiments/device/tpu_projection.py --out results/tpu_v5e/projection_in_place

Records: <out>/records.jsonl (one per strategy, chips and kernel, with the projection's split
and the timings file it read); table: <out>/table.md. Workloads (FLOPs and collectives from
PixArt-α's programs lowered here with abstract weights) are cached in <out>/workloads.jsonl.

Then the published multi-chip TPU figures (../shared/ANCHORS.md), each beside the projection of
the same run and its error; nothing is fitted on them. They are data parallel, one image per
chip, so each is one chip's latency per image: SDXL's UNet priced by its time measured on this
chip (`peer_chunked/`), the encoders, the VAE and every model on v6e by the profile's fitted
curve (borrowed from a100-sxm). <out>/published.jsonl and published.md.
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
    # the later folders' points replace the earlier ones' (the N = 4 and 8 points of
    # sync_patch and distrifusion timed again with opaque stand-ins: `shards_opaque`)
    "chunked 256x512": (
        ("shards_chunked", "shards_strategies_chunked", "shards_context8", "shards_opaque"),
        ("sync_patch", "distrifusion", "pcpp", "ulysses", "ring"),
    ),
    "splash 256x512": (
        ("shards", "shards_strategies", "shards_distrifusion8"),
        ("sync_patch", "distrifusion", "pcpp", "ulysses", "ring"),
    ),
    # K/V read where it lies (one run at c0e956b, blocks scanned; stale programs timed with
    # their stale exchanges left out, which the steady phase reads and, lacking a stood-in
    # record, the warm-up phase too)
    "chunked 256x512, K/V in place": (("shards_in_place",), ("sync_patch", "distrifusion", "pcpp")),
}


# (model, steps, hardware, what, published seconds per image on one chip, source)
PUBLISHED = [
    ("sdxl", 20, "tpu-v5e", "MLPerf v4.1 SDXL on v5e-4, minimum latency", 2.40,
     "mlcommons/inference_results_v4.1, closed/Google, tpu_v5e_x4_flax"),
    ("sdxl", 20, "tpu-v5e", "MLPerf v4.1 SDXL on v5e-4, offline 1.753 samples/s over 4 chips",
     4 / 1.753, "same"),
    ("sdxl", 20, "tpu-v6e", "MLPerf v4.1 SDXL on v6e-4, offline 5.439 samples/s over 4 chips",
     4 / 5.439, "mlcommons/inference_results_v4.1, closed/Google, tpu_v6_x4_flax"),
    ("flux-dev", 28, "tpu-v6e", "MaxDiffusion FLUX.1-dev 1024², batch 4 on v6e-4, data parallel",
     5.5, "AI-Hypercomputer/maxdiffusion README"),
    ("flux-schnell", 4, "tpu-v6e", "MaxDiffusion FLUX.1-schnell, batch 4 on v6e-4, data parallel",
     0.8, "same"),
]  # fmt: skip
NOT_PROJECTED = (
    "MaxDiffusion Wan 2.2 720p on v7x-8 (194.4 s) and v7x-16 (106.0 s): patchpar has no video "
    "family yet and no v7x profile"
)


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
    from patchpar.measure.projection import project
    from patchpar.measure.workload import WorkloadCache

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
    _write_jsonl(a.out / "records.jsonl", rows)
    (a.out / "table.md").write_text(table(rows))
    print(table(rows))
    checks = published(cache, prov)
    _write_jsonl(a.out / "published.jsonl", checks)
    (a.out / "published.md").write_text(published_md(checks))
    print(published_md(checks))
    return 0


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """Whole or not at all: a temporary file, then a rename."""
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    tmp.replace(path)


def published(cache, prov) -> list[dict]:
    """Each published figure beside the projection of one image on one chip."""
    from patchpar import hardware
    from patchpar.lab.config import build_plan
    from patchpar.lab.results import read_records
    from patchpar.measure.projection import project

    peer = read_records(RESULTS / "peer_chunked" / "records.jsonl")
    unet = [r for r in peer if r["implementation"] == "patchpar" and r["model"] == "sdxl"]
    rows = []
    for model, steps, hw_name, what, seconds, source in PUBLISHED:
        hw = hardware.load(hw_name)
        w = cache.get(model, RESOLUTION, build_plan("single", {}, 1, 1), 1, "bfloat16")
        measured = None
        if hw_name == "tpu-v5e" and model == "sdxl" and unet:  # the UNet call timed on the chip
            t = unet[-1]["call_s_median"]
            measured = {"warmup": t, "steady": t, "single": t}
        p = project(w, w, hw, steps, measured=measured)
        rows.append({
            "model": model, "resolution": RESOLUTION, "steps": steps, "hardware": hw_name,
            "what": what, "source": source, "published_s": seconds, "projected_s": p.latency_s,
            "error": p.latency_s / seconds - 1, "compute_s": p.compute_s,
            "encode_s": p.encode_s, "decode_s": p.decode_s, "compute_source": p.compute_source,
            "provenance": prov,
        })  # fmt: skip
    return rows


def published_md(rows) -> str:
    lines = [
        "Published multi-chip TPU figures (data parallel, one image per chip) beside the "
        "projection of one image on one chip at 1024²: seconds per image, the error, and the "
        "projection's split (denoiser calls, text encoders, VAE decode)",
        "",
        "| run | steps | published s | projected s | error | denoiser s | encoders s | VAE s | "
        "denoiser compute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['steps']} | {r['published_s']:.3f} | {r['projected_s']:.3f} | "
            f"{r['error']:+.0%} | {r['compute_s']:.3f} | {r['encode_s']:.3f} | "
            f"{r['decode_s']:.3f} | {r['compute_source']} |"
        )
    return "\n".join([*lines, "", f"Not projected: {NOT_PROJECTED}."]) + "\n"


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
