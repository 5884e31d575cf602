"""The tables of results/tpu_v5e/README.md, from the records the device suite brought back:
per family at each resolution, every kernel's ms per call and MFU (the FLOPs from the `flops`
part where a timing record has none), and FLUX.1-dev at full depth from its two reduced depths.

    python experiments/device/tpu_tables.py [results/tpu_v5e]      -> <folder>/tables.md

FLUX.1-dev's time and FLOPs are linear in its depth (its blocks are identical and run one after
another): with depth d = double blocks (single blocks = 2 d, as in the full model), two measured
depths give per-depth cost and the rest (embedders, final layer), and the full model (d = 19) is
the line at 19. MFU of the full model is its FLOPs over its time, the same line's.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

PEAK = 197e12  # tpu-v5e bf16 (patchpar/hardware/tpu-v5e.yaml)
FULL_FLUX_DEPTH = 19


def records(folder: Path) -> list[dict]:
    out = []
    for f in sorted(folder.glob("*/records.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            r["part"] = f.parent.name
            out.append(r)
    return out


def kernel(r: dict) -> str:
    k = r["attention"]
    return f"{k} {r['block_q']}x{r['block_kv']}" if k in ("splash", "chunked") else k


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else "results/tpu_v5e")
    recs = records(folder)
    flops = {(r["model"], r["resolution"]): r["flops"] for r in recs if r["part"] == "flops"}
    timed = defaultdict(dict)  # (model, res) -> kernel -> record (the last run of each)
    for r in recs:
        if r.get("status") == "ok" and r.get("call_s_median"):
            r["flops"] = r.get("flops") if r.get("flops") == r.get("flops") else None
            r["flops"] = r["flops"] or flops.get((r["model"], r["resolution"]))
            timed[(r["model"], r["resolution"])][kernel(r)] = r
    lines = [
        "Made by `python experiments/device/tpu_tables.py` from the records beside it.",
        "",
        "| model | px | batch | TFLOP | kernel | ms per call | MFU | compiled GiB | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, res), by_kernel in timed.items():
        for k, r in sorted(by_kernel.items(), key=lambda kv: -kv[1]["call_s_median"]):
            f = r["flops"]
            mfu = f"{f / r['call_s_median'] / PEAK:.0%}" if f else "-"
            lines.append(
                f"| {model} | {res} | {r['batch']} | {f / 1e12 if f else float('nan'):.2f} | {k} "
                f"| {r['call_s_median'] * 1e3:.1f} | {mfu} | "
                f"{r['memory_compiled']['total'] / 2**30:.2f} | {r['compile_s']:.0f} |"
            )
    lines += ["", *flux_full(timed)]
    (folder / "tables.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def flux_full(timed) -> list[str]:
    """FLUX.1-dev at depth 19 from the reduced depths measured, per kernel measured at both."""
    depth = {}
    for model, res in timed:
        m = re.fullmatch(r"flux-dev:num_layers=(\d+),num_single_layers=(\d+)", model)
        if m and int(m[2]) == 2 * int(m[1]):
            depth[(model, res)] = int(m[1])
    out = [
        f"FLUX.1-dev at its full depth ({FULL_FLUX_DEPTH} double + {2 * FULL_FLUX_DEPTH} single "
        "blocks), the line through two reduced depths:",
        "",
        "| px | kernel | depths | ms per call | TFLOP | MFU |",
        "|---|---|---|---|---|---|",
    ]
    by_res = defaultdict(list)
    for (model, res), d in depth.items():
        by_res[res].append((d, timed[(model, res)]))
    for res, points in sorted(by_res.items()):
        points.sort(key=lambda p: p[0])
        if len(points) < 2:
            continue
        (d0, k0), (d1, k1) = points[0], points[-1]
        for k in sorted(set(k0) & set(k1)):
            t0, t1 = k0[k]["call_s_median"], k1[k]["call_s_median"]
            f0, f1 = k0[k]["flops"], k1[k]["flops"]
            t = t0 + (t1 - t0) / (d1 - d0) * (FULL_FLUX_DEPTH - d0)
            f = f0 + (f1 - f0) / (d1 - d0) * (FULL_FLUX_DEPTH - d0)
            out.append(
                f"| {res} | {k} | {d0}, {d1} | {t * 1e3:.0f} | {f / 1e12:.1f} | "
                f"{f / t / PEAK:.0%} |"
            )
    return out


if __name__ == "__main__":
    main()
