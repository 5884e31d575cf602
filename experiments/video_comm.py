"""Communication and memory per device for full-size Wan 2.1 (1.3B, 14B) at 480p and 720p x 81
frames, lowered with abstract bf16 parameters (no weights): every strategy of the engine's step
on 2, 4 and 8 devices, and, on 6 devices, every layout of the patches (frames, rows, a 3 x 2
frame x row grid).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python experiments/video_comm.py

Writes runs/video_comm/runs.jsonl (resumable: points already recorded are skipped) and
runs/video_comm/table.md (`--out results/video_comm`: the published). One model call with the
CFG pair in its batch (cfg=1, batch 1 -> model batch 2), 512 umT5 tokens, bfloat16; lowered
only (no compile), so memory is the stale buffers' and the weights' bytes, not the program's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax.numpy as jnp
from tqdm import tqdm

from patchpar.lab.checks import check_video
from patchpar.lab.results import append_record, provenance, read_records
from patchpar.measure.cost import measure
from patchpar.models.attention import AttentionSpec, resolve
from patchpar.models.presets import abstract_denoiser, latent_factor
from patchpar.parallel.engine import Plan
from patchpar.parallel.strategies import make_strategy

OUT = Path("runs/video_comm")
FRAMES = 81
SIZES = {"480p": (480, 832), "720p": (720, 1280)}
MODELS = ("wan2.1-1.3b", "wan2.1-14b")
DEVICES = (2, 4, 8)
STRATEGIES = (
    ("sync_patch", {}),
    ("distrifusion", {}),
    ("pcpp", {"portion": 0.3, "send": "band"}),
    ("ring", {}),
    ("ulysses", {}),
    ("tensor", {}),
)
# the layouts compared at one point (the rest run frame after frame): 6 devices, where a grid
# fits 480p x 81 frames (21 latent frames x 30 token rows: 3 x 2; on 8 none does)
LAYOUT_POINT = ("wan2.1-1.3b", "480p", 6)
LAYOUTS = ("frames", "rows", "3x2")


def points():
    """(model, size, devices, strategy, options, layout) in order: the layouts' point first."""
    m, size, n = LAYOUT_POINT
    out = [(m, size, n, s, o, lay) for lay in LAYOUTS for s, o in STRATEGIES]
    for model in MODELS:
        for size in SIZES:
            for n in DEVICES:
                out += [(model, size, n, s, o, "frames") for s, o in STRATEGIES]
    seen, once = set(), []
    for p in out:  # each once (the layouts' point repeats its frames rows)
        k = (*p[:3], p[3], str(sorted(p[4].items())), p[5])
        if k not in seen:
            seen.add(k)
            once.append(p)
    return once


def key(r: dict) -> tuple:
    return (r["model"], r["size"], r["devices"], r["strategy"], r["layout"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-only", action="store_true", help="only rewrite the table")
    ap.add_argument(
        "--out", type=Path, default=OUT, help="records folder (default runs/video_comm)"
    )
    ap.add_argument(
        "--memory", action="store_true",
        help="instead: the compiled steady program's memory per device at 720p on 8 devices "
        "(and one device's single), per strategy, both models (a minute or two a point)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    runs = args.out / "runs.jsonl"
    if not args.table_only:
        run(runs, MEMORY_POINTS if args.memory else None)
    write_table(read_records(runs, skip_bad=True), args.out / "table.md")
    return 0


# --memory: 720p, the single program on one device and each strategy's on 8 (compiled for the
# CPU, chunked attention: XLA's buffer assignment per device)
MEMORY_POINTS = [
    (model, "720p", n, s, o, "frames")
    for model in MODELS
    for n, (s, o) in [(1, ("single", {}))] + [(8, so) for so in STRATEGIES[:5]]
]


def run(runs: Path, memory_points=None) -> None:
    """Every point's record (`memory_points`: those points, compiled for their memory)."""
    done = {key(r) for r in read_records(runs, skip_bad=True)}
    prov = provenance()
    spec = resolve(AttentionSpec(), jnp.bfloat16)  # auto: chunked on CPU
    models = {}
    todo = points() if memory_points is None else memory_points
    for model, size, n, strat, opts, layout in tqdm(todo, desc="video comm", unit="point"):
        strategy = make_strategy(strat, **opts)
        point = {"model": model, "size": size, "frames": FRAMES, "devices": n,
                 "strategy": strategy.describe(), "layout": layout}  # fmt: skip
        if key(point) in done:
            continue
        tqdm.write(f"{model} {size} x {FRAMES} frames, {n} devices, {layout}: {point['strategy']}")
        unet = models.setdefault(model, abstract_denoiser(model, jnp.bfloat16, spec))
        f = latent_factor(model)
        h, w = SIZES[size]
        plan = Plan(strategy, n, 1)
        t0 = time.perf_counter()
        try:
            at, hw = check_video(model, unet, (h // f, w // f), FRAMES, layout, plan)
            r = measure(at, plan, hw, batch=1, params=unet.abstract_params(),
                        memory=memory_points is not None)  # fmt: skip
            status = {"status": "ok", "latent_hw": list(hw), "tokens": at.image_tokens(*hw)}
        except Exception as e:  # a failed point is a row with its error, and the sweep goes on
            r, status = None, {"status": "error", "error": f"{type(e).__name__}: {e}"}
        rec = {**point, "experiment": "video_comm", "dtype": "bfloat16", "cfg": 1,
               "unet_batch": unet.guidance_halves, "attention": spec.impl, **status,
               "provenance": prov}  # fmt: skip
        if r is not None:
            st, wu = r["phases"]["steady"], r["phases"]["warmup"]
            rec.update(
                steady_bytes_per_device=st["hlo"]["all"]["max"],
                warmup_bytes_per_device=wu["hlo"]["all"]["max"],
                steady_by_site={k: v["max"] for k, v in st["hlo"].items() if k != "all"},
                steady_padding_bytes=st.get("padding", {}).get("all", {}).get("max", 0),
                analytic_matches_hlo=st["analytic_matches_hlo"] and wu["analytic_matches_hlo"],
                flops_per_device=st.get("flops_per_device"),
                stale_bytes_per_device=r["stale_bytes_per_device"],
                weight_bytes_per_device=r["weight_bytes_per_device"],
                **({"memory": st["memory"]} if "memory" in st else {}),
                seconds=round(time.perf_counter() - t0, 1),
            )
        append_record(runs, rec)


def write_table(records: list[dict], path: Path) -> None:
    """One row per point: GiB received per device per model call (warm-up, steady), stale
    buffers and weights per device, TFLOP per device, whether HLO equals the analytic model."""
    gib = 2**30
    lines = [
        f"Wan 2.1 at {FRAMES} frames, one model call (CFG pair, 512 umT5 tokens), bfloat16, "
        "lowered with abstract weights: per device",
        "",
        "| model | size | devices | layout | strategy | GiB warm-up | GiB steady | stale GiB | "
        "weights GiB | TFLOP | memory GiB | HLO = analytic | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def g(v):
        return "-" if v is None else f"{v / gib:.2f}"

    for r in records:
        flops = r.get("flops_per_device")
        lines.append(
            f"| {r['model']} | {r['size']} | {r['devices']} | {r['layout']} | "
            f"{r['strategy'].split('(')[0]}{'' if 'band' not in r['strategy'] else ' band'} | "
            f"{g(r.get('warmup_bytes_per_device'))} | {g(r.get('steady_bytes_per_device'))} | "
            f"{g(r.get('stale_bytes_per_device'))} | {g(r.get('weight_bytes_per_device'))} | "
            f"{'-' if flops is None else f'{flops / 1e12:.1f}'} | "
            f"{g((r.get('memory') or {}).get('total'))} | "
            f"{'yes' if r.get('analytic_matches_hlo') else '-' if r['status'] != 'ok' else 'NO'} "
            f"| {r['status'] if r['status'] == 'ok' else r.get('error', '')[:80]} |"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
