"""Where a traced call's time goes on the device: XLA's own per-op statistics (xprof's
`hlo_stats`) of the traces `family_timing.py --profile DIR` wrote, grouped by op category, with
the slowest ops, their FLOP rate and what bounds them.

    here:  pip install xprof   (a separate environment will do: it is not patchpar's need)
           python experiments/device/profile_ops.py results/tpu_v5e/profile/trace \
               --calls 2 --out results/tpu_v5e/profile/ops.md

Each DIR/<point>/ holds one jax.profiler trace of `--calls` calls of one compiled program. The
table per point: the device's busy time per call (the sum of the ops' self time over the calls),
its share per op category (convolution, fusion, custom-call: the Pallas splash kernel, ...), and
the `--top` ops by self time with the GFLOP/s XLA's cost model gives them and whether the
profiler finds them bound by compute or memory. Needs only xprof (it reads the .xplane.pb).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", type=Path, help="the folder family_timing.py --profile wrote")
    p.add_argument("--calls", type=int, default=2, help="calls traced per point")
    p.add_argument("--top", type=int, default=12, help="ops listed per point")
    p.add_argument("--out", type=Path, help="markdown file (default: stdout)")
    return p.parse_args(argv)


def hlo_stats(xplanes: list[Path]) -> list[dict]:
    """xprof's hlo_stats of the trace: one dict per op, keyed by column id."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([str(x) for x in xplanes], "hlo_stats", {})
    if not data:
        raise SystemExit(f"profile_ops: xprof found no hlo_stats in {xplanes[0].parent}")
    table = json.loads(data)
    ids = [c["id"] for c in table["cols"]]
    return [{k: (c or {}).get("v") for k, c in zip(ids, row["c"])} for row in table["rows"]]


def summarize(name: str, ops: list[dict], calls: int, top: int) -> list[str]:
    busy = sum(o["total_self_time"] for o in ops) / calls / 1e3  # ms per call
    by_cat = defaultdict(float)
    for o in ops:
        by_cat[o["category"]] += o["total_self_time"] / calls / 1e3
    lines = [
        f"### {name}",
        "",
        f"Device busy {busy:.1f} ms per call (ops' self time); by category:",
        "",
        "| category | ms per call | share |",
        "|---|---|---|",
    ]
    for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {cat} | {ms:.1f} | {ms / busy:.0%} |")
    lines += [
        "",
        "| op | category | calls | ms per call | share | model TFLOP/s | bound by | expression |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in sorted(ops, key=lambda o: -o["total_self_time"])[:top]:
        ms = o["total_self_time"] / calls / 1e3
        expr = (o.get("hlo_op_expression") or "").replace("|", "/").replace("\n", " ")[:90]
        rate = o.get("model_flop_rate") or 0.0
        lines.append(
            f"| {o['hlo_op_name']} | {o['category']} | {o['occurrences'] // calls} | {ms:.2f} | "
            f"{ms / busy:.1%} | {rate / 1e3:.1f} | {o.get('bound_by') or '-'} | `{expr}` |"
        )
    return lines + [""]


def main(argv=None) -> None:
    a = parse(argv)
    try:
        import xprof  # noqa: F401
    except ImportError:
        sys.exit("profile_ops: needs xprof (pip install xprof) to read the .xplane.pb traces")
    points = sorted(d for d in a.traces.iterdir() if d.is_dir()) if a.traces.is_dir() else []
    if not points:
        sys.exit(f"profile_ops: no traced points under {a.traces} (family_timing.py --profile)")
    lines = [f"Per-op device time of the traces under `{a.traces}` (xprof hlo_stats)", ""]
    for point in points:
        xplanes = sorted(point.rglob("*.xplane.pb"))
        if not xplanes:
            lines += [f"### {point.name}", "", "no .xplane.pb in this folder", ""]
            continue
        ops = [o for o in hlo_stats(xplanes[-1:]) if o.get("total_self_time")]
        if not ops:  # XLA:CPU records no per-op device events
            lines += [f"### {point.name}", "", "no device ops in this trace", ""]
            continue
        lines += summarize(point.name, ops, a.calls, a.top)
    text = "\n".join(lines)
    if a.out:
        a.out.write_text(text)
        print(f"-> {a.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
