"""Where a traced call's time goes on the device: XLA's own per-op statistics (xprof's
`hlo_stats`) of the traces `family_timing.py --profile DIR` wrote, grouped by op category, with
the slowest ops, their FLOP rate and what bounds them.

    here:  pip install xprof   (a separate environment will do: it is not patchpar's need)
           python experiments/device/profile_ops.py results/tpu_v5e/profile/trace \
               --calls 2 --out results/tpu_v5e/profile/ops.md    [--by-shape]

Each DIR/<point>/ holds one jax.profiler trace of `--calls` calls of one compiled program. The
table per point: the device's busy time per call (the sum of the ops' self time over the calls),
its share per op category (convolution, fusion, custom-call: the Pallas splash kernel, ...), and
the `--top` ops by self time with the GFLOP/s XLA's cost model gives them and whether the
profiler finds them bound by compute or memory. Needs only xprof (it reads the .xplane.pb).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", type=Path, help="the folder family_timing.py --profile wrote")
    p.add_argument("--calls", type=int, default=2, help="calls traced per point")
    p.add_argument("--top", type=int, default=12, help="ops listed per point")
    p.add_argument("--out", type=Path, help="markdown file (default: stdout)")
    p.add_argument(
        "--by-shape", action="store_true",
        help="list ops grouped by category and result shape (an unrolled program runs each "
        "layer's ops as ops of their own: grouped, the per-layer ops of one kind sum)",
    )  # fmt: skip
    return p.parse_args(argv)


def hlo_stats(xplanes: list[Path]) -> list[dict]:
    """xprof's hlo_stats of the trace: one dict per op, keyed by column id."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([str(x) for x in xplanes], "hlo_stats", {})
    if not data:
        raise SystemExit(f"profile_ops: xprof found no hlo_stats in {xplanes[0].parent}")
    table = json.loads(data)
    ids = [c["id"] for c in table["cols"]]
    return [
        {k: (c or {}).get("v") for k, c in zip(ids, row["c"], strict=True)} for row in table["rows"]
    ]


_TYPE = re.compile(r"(?:ROOT )?%?[\w.\-]+ = (.+?) [\w\-]+\(")  # an HLO expression's result type


def by_shape(ops: list[dict]) -> list[dict]:
    """Ops of one category with one result type (shape and layout, e.g.
    `bf16[2,16,512,72]{2,3,1,0:...}`) as one row: occurrences and self time summed, the FLOP
    rate weighted by time, named by the first and how many more (`fusion.7 (+27 same
    shape)`); custom calls (`by_kernel` groups them) and an expression without a type stay
    rows of their own."""
    rows, groups = [], {}
    for o in ops:
        m = _TYPE.match(o.get("hlo_op_expression") or "")
        if o["category"] == "custom-call" or not m:
            rows.append(o)
            continue
        key = (o["category"], m.group(1))
        if key not in groups:
            groups[key] = [o]
            rows.append(key)
        else:
            groups[key].append(o)
    return [_merged(groups[r]) if isinstance(r, tuple) else r for r in rows]


def _merged(ops: list[dict]) -> dict:
    """One row for ops of one kind (`by_shape`)."""
    if len(ops) == 1:
        return ops[0]
    time = sum(o["total_self_time"] for o in ops)
    rate = sum((o.get("model_flop_rate") or 0.0) * o["total_self_time"] for o in ops)
    bound = {o.get("bound_by") for o in ops}
    return {
        **ops[0],
        "hlo_op_name": f"{ops[0]['hlo_op_name']} (+{len(ops) - 1} same shape)",
        "occurrences": sum(o["occurrences"] for o in ops),
        "total_self_time": time,
        "model_flop_rate": rate / time if time else 0.0,
        "bound_by": bound.pop() if len(bound) == 1 else "mixed",
    }


def summarize(
    name: str, ops: list[dict], calls: int, top: int, flops: float | None, shapes: bool = False
) -> list[str]:
    """Markdown: busy time per call, the split by op category with the FLOP rate XLA's cost
    model gives each, the custom calls' rate from the program's FLOPs (`flops`, the point's
    record) less what XLA counts in the other ops, and the slowest ops."""
    busy = sum(o["total_self_time"] for o in ops) / calls / 1e3  # ms per call
    ms, tflop = defaultdict(float), defaultdict(float)
    for o in ops:
        t = o["total_self_time"] / calls / 1e3
        ms[o["category"]] += t
        tflop[o["category"]] += (o.get("model_flop_rate") or 0.0) * 1e9 * t / 1e3 / 1e12
    counted = sum(tflop.values())
    if flops and ms.get("custom-call"):  # a Pallas kernel's FLOPs: not in XLA's count
        tflop["custom-call"] = max(flops / 1e12 - counted, 0.0)
    lines = [
        f"### {name}",
        "",
        f"Device busy {busy:.1f} ms per call (the ops' self time), "
        + (f"{flops / 1e12:.2f} TFLOP per call (the program's count)" if flops else ""),
        "",
        "| category | ms per call | share | TFLOP per call | TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for cat, t in sorted(ms.items(), key=lambda kv: -kv[1]):
        if t < 0.05:
            continue
        rate = tflop[cat] / (t / 1e3) if tflop[cat] else 0.0
        lines.append(
            f"| {cat} | {t:.1f} | {t / busy:.0%} | {tflop[cat]:.2f} | "
            + (f"{rate:.0f} |" if rate else "- |")
        )
    lines += [
        "",
        "| op | category | calls | ms per call | share | TFLOP/s | bound by | expression |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = by_shape(by_kernel(ops)) if shapes else by_kernel(ops)
    for o in sorted(rows, key=lambda o: -o["total_self_time"])[:top]:
        t = o["total_self_time"] / calls / 1e3
        expr = (o.get("hlo_op_expression") or "").replace("|", "/").replace("\n", " ")[:90]
        rate = (o.get("model_flop_rate") or 0.0) / 1e3
        lines.append(
            f"| {o['hlo_op_name']} | {o['category']} | {int(o['occurrences'] // calls)} | {t:.2f} | "
            f"{t / busy:.1%} | {rate:.0f} | {o.get('bound_by') or '-'} | `{expr}` |"
        )
    return lines + [""]


def by_kernel(ops: list[dict]) -> list[dict]:
    """The custom calls of one kernel (`splash_mha_fwd_no_residuals.42`, `.43`, ...) as one row:
    their occurrences and self time summed, the first one's expression; other ops unchanged."""
    rows, kernels = [], {}
    for o in ops:
        if o["category"] != "custom-call":
            rows.append(o)
            continue
        stem = o["hlo_op_name"].rsplit(".", 1)[0]
        if stem in kernels:
            k = kernels[stem]
            k["occurrences"] += o["occurrences"]
            k["total_self_time"] += o["total_self_time"]
        else:
            kernels[stem] = {**o, "hlo_op_name": f"{stem}.*"}
            rows.append(kernels[stem])
    return rows


def point_flops(traces: Path) -> dict[str, float]:
    """The program FLOPs of each traced point, from the records beside the traces' folder."""
    records = traces.parent / "records.jsonl"
    out = {}
    if records.exists():
        for line in records.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("profile") and rec.get("flops"):
                out[rec["profile"]] = rec["flops"]
    return out


def main(argv=None) -> None:
    a = parse(argv)
    try:
        import xprof  # noqa: F401
    except ImportError:
        sys.exit("profile_ops: needs xprof (pip install xprof) to read the .xplane.pb traces")
    points = sorted(d for d in a.traces.iterdir() if d.is_dir()) if a.traces.is_dir() else []
    if not points:
        sys.exit(f"profile_ops: no traced points under {a.traces} (family_timing.py or "
                 "shard_timing.py --profile)")  # fmt: skip
    flops = point_flops(a.traces)
    lines = [
        f"Per-op device time: xprof's hlo_stats of jax.profiler traces of {a.calls} calls per "
        "point (`family_timing.py` or `shard_timing.py --profile`; read by `profile_ops.py`"
        + (", ops of one category and result type summed: `--by-shape`)" if a.by_shape else ")"),
        "",
    ]
    for point in points:
        xplanes = sorted(point.rglob("*.xplane.pb"))
        if not xplanes:
            lines += [f"### {point.name}", "", "no .xplane.pb in this folder", ""]
            continue
        ops = [o for o in hlo_stats(xplanes[-1:]) if o.get("total_self_time")]
        if not ops:  # XLA:CPU records no per-op device events
            lines += [f"### {point.name}", "", "no device ops in this trace", ""]
            continue
        lines += summarize(point.name, ops, a.calls, a.top, flops.get(point.name), a.by_shape)
    text = "\n".join(lines)
    if a.out:
        a.out.write_text(text)
        print(f"-> {a.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
