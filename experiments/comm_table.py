"""Communication per device for full-size SD 1.5, SDXL and PixArt-α, lowered with abstract
bf16 parameters (no weights): DistriFusion Table 2's setting, xDiT's cost table, and beyond.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python experiments/comm_table.py

Writes runs/comm/runs.jsonl (resumable: points already recorded are skipped) and
runs/comm/table.md (`--out results/comm`: the published). One model call with the CFG pair in
its batch (cfg=1, batch 1 -> model batch 2), 77 text tokens (PixArt: 120 T5 tokens), bfloat16.
FLUX.1-dev: one guidance half (its scale is an input: model batch 1), 512 T5 tokens. SD3.5:
the CFG pair, 77 CLIP + 256 T5 tokens.
`--models pixart-alpha` runs one model's points only (`--models flux-dev --out results/flux/comm`
for the FLUX report).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax.numpy as jnp
from tqdm import tqdm

from patchpar.lab.results import append_record, provenance, read_records
from patchpar.measure.cost import measure
from patchpar.models.attention import AttentionSpec, resolve
from patchpar.models.presets import abstract_denoiser, family
from patchpar.parallel.engine import Plan
from patchpar.parallel.strategies import make_strategy

OUT = Path("runs/comm")
GRID = {
    "sdxl": (1024, 2048, 3840),
    "sd15": (512, 1024, 2048),
    "pixart-alpha": (1024, 2048),
    "flux-dev": (1024, 2048),
    "sd3.5-medium": (1024,),
    "sd3.5-large": (1024,),
}
DEVICES = (2, 4, 8)
STRATEGIES = (
    ("naive_patch", {}),
    ("sync_patch", {}),
    ("distrifusion", {}),
    ("pcpp", {"portion": 0.3, "send": "full"}),
    ("pcpp", {"portion": 0.3, "send": "band"}),
    ("ring", {}),
    ("ulysses", {}),
    ("tensor", {}),
)
# Strategies for a model family only: PCPP's band in whole token rows (a DiT's 2-D neighbours),
# PipeFusion (a stack of identical blocks; M = S patches, one full warm-up pass)
FAMILY_STRATEGIES = {
    "pixart": (
        ("pcpp", {"portion": 0.3, "send": "band", "align": "rows"}),
        ("pipefusion", {}),
    ),
    # an MMDiT: the text-stream policies of the stale strategies, and compressed exchange
    "flux": (
        ("pcpp", {"portion": 0.3, "send": "band", "align": "rows"}),
        ("distrifusion", {"text": "mean"}),
        ("distrifusion", {"text": "first"}),
        ("compact", {}),
        ("pipefusion", {}),  # two segments: M = the least >= 2(S-1)+1 that splits the rows
    ),
}
# SD3 / SD3.5: the same (PipeFusion: one segment on SD3.5-large; none on medium's dual blocks)
FAMILY_STRATEGIES["sd3"] = FAMILY_STRATEGIES["flux"]


def key(r: dict) -> tuple:
    return (r["model"], r["resolution"], r["devices"], r["strategy"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(GRID))
    ap.add_argument(
        "--table-only", action="store_true", help="only rewrite the tables from runs.jsonl"
    )
    ap.add_argument("--out", type=Path, default=OUT, help="records folder (default runs/comm)")
    args = ap.parse_args(argv)
    out = args.out
    if args.table_only:
        write_table(read_records(out / "runs.jsonl", skip_bad=True), out / "table.md")
        return 0
    runs = out / "runs.jsonl"
    done = {key(r) for r in read_records(runs, skip_bad=True)}
    bad = sorted(set(args.models) - set(GRID))
    if bad:
        ap.error(f"--models {bad}: not in the grid; known: {sorted(GRID)}")
    points = [
        (m, res, n, s, o)
        for m in args.models
        for res in GRID[m]
        for n in DEVICES
        for s, o in STRATEGIES + FAMILY_STRATEGIES.get(family(m), ())
    ]
    prov = provenance()
    unets = {}
    for model, res, n, strat, opts in tqdm(points, desc="comm", unit="point"):
        strategy = make_strategy(strat, **opts)
        point = {"model": model, "resolution": res, "devices": n, "strategy": strategy.describe()}
        if key(point) in done:
            continue
        tqdm.write(f"{model} {res}px {n} devices {strategy.describe()}")
        spec = resolve(AttentionSpec(), jnp.bfloat16)  # auto: chunked on CPU
        unet = unets.setdefault(model, abstract_denoiser(model, jnp.bfloat16, spec))
        t0 = time.perf_counter()
        try:
            r = measure(
                unet,
                Plan(strategy, n, 1),
                (res // 8, res // 8),
                batch=1,
                params=unet.abstract_params(),
            )
            status = {"status": "ok"}
        except Exception as e:  # a failed point is a row with its error, and the sweep goes on
            r, status = None, {"status": "error", "error": f"{type(e).__name__}: {e}"}
        rec = {
            **point,
            "experiment": "comm",
            "dtype": "bfloat16",
            "cfg": 1,
            "unet_batch": unet.guidance_halves,  # one image: its guidance halves
            "attention": unet.module.attn.impl,  # FLOPs: its loops counted in full
            **status,
            "provenance": prov,
        }
        if r is not None:
            st, wu = r["phases"]["steady"], r["phases"]["warmup"]
            rec.update(
                steady_bytes_per_device=st["hlo"]["all"]["max"],
                warmup_bytes_per_device=wu["hlo"]["all"]["max"],
                steady_bytes_mean=st["hlo"]["all"]["mean"],
                steady_bytes_total=st["hlo"]["all"]["total"],
                warmup_bytes_mean=wu["hlo"]["all"]["mean"],
                warmup_bytes_total=wu["hlo"]["all"]["total"],
                steady_by_site={k: v["max"] for k, v in st["hlo"].items() if k != "all"},
                warmup_by_site={k: v["max"] for k, v in wu["hlo"].items() if k != "all"},
                analytic_matches_hlo=st["analytic_matches_hlo"] and wu["analytic_matches_hlo"],
                released_steady_bytes_per_device=st["released"]["all"]["max"],
                released_warmup_bytes_per_device=wu["released"]["all"]["max"],
                released_steady_by_site={
                    k: v["max"] for k, v in st["released"].items() if k != "all"
                },
                flops_per_device=st.get("flops_per_device"),
                stale_bytes_per_device=r["stale_bytes_per_device"],
                weight_bytes_per_device=r["weight_bytes_per_device"],
                mesh=r["mesh"],
                seconds=round(time.perf_counter() - t0, 1),
            )
        append_record(runs, rec)
    write_table(read_records(runs, skip_bad=True), out / "table.md")
    return 0


def write_table(records: list[dict], path: Path) -> None:
    from patchpar.lab.comm_report import (
        comm_markdown,
        distrifusion_table2_markdown,
        tensor_parallel_markdown,
        xdit_cost_markdown,
    )

    path.write_text(comm_markdown(records))
    tables = {
        "distrifusion_table2.md": distrifusion_table2_markdown(records),
        "tensor_parallel.md": tensor_parallel_markdown(records),
        "xdit_cost.md": xdit_cost_markdown(records),
    }
    for name, text in tables.items():
        (path.parent / name).write_text(text)
    print(f"wrote {path} and {', '.join(tables)} beside it")


if __name__ == "__main__":
    sys.exit(main())
