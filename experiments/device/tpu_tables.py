"""The tables of results/tpu_v5e/README.md, from the records the device suite brought back:
per family at each resolution, every kernel's ms per call and MFU (the FLOPs from the `flops`
part where a timing record has none), FLUX.1-dev at full depth from its two reduced depths,
patchpar beside its JAX peer (`peer` part), and each strategy's per-device program against the
single one (`shards` part: N x per-device time / single time, the efficiency loss that bounds
every N-way speedup).

    python experiments/device/tpu_tables.py [results/tpu_v5e]      -> <folder>/tables.md

FLUX.1-dev's time and FLOPs are linear in its depth (its blocks are identical and run one after
another): with depth d = double blocks (single blocks = 2 d, as in the full model), two measured
depths give per-depth cost and the rest (embedders, final layer), and the full model (d = 19) is
the line at 19. MFU of the full model is its FLOPs over its time, the same line's.
"""

from __future__ import annotations

import functools
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
    k = f"{k} {r['block_q']}x{r['block_kv']}" if k in ("splash", "chunked") else k
    return k + ", scanned" if r.get("scan_blocks") else k


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0] if argv else "results/tpu_v5e")
    recs = records(folder)
    flops = {(r["model"], r["resolution"]): r["flops"] for r in recs if r["part"] == "flops"}
    timed = defaultdict(dict)  # (model, res) -> kernel -> record (the last run of each)
    for r in recs:
        ok = r.get("status") == "ok" and r.get("call_s_median")
        if ok and "model" in r and "implementation" not in r:  # attention_sources': no model
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
    lines += ["", *flux_full(timed), "", *peer(recs), "", *shards(recs)]
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


def peer(recs) -> list[str]:
    """patchpar and the peer per kernel, MFU of one FLOP count (patchpar's xla program's)."""
    rows = [r for r in recs if r.get("implementation") and r.get("status") == "ok"]
    out = [
        "patchpar beside its JAX peer, one program, the same config and inputs (MFU of the "
        "model's FLOPs: patchpar's xla program's count; `vs peer`: time over the peer's best):",
        "",
        "| model | px | implementation | attention | ms per call | MFU | vs peer | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted({(r["model"], r["resolution"]) for r in rows}):
        group = [r for r in rows if (r["model"], r["resolution"]) == key]
        xla = [r for r in group if r["implementation"] == "patchpar" and r["attention"] == "xla"]
        flops = xla[0]["program_flops"] if xla else None
        peers = [r["call_s_median"] for r in group if r["implementation"] != "patchpar"]
        best = min(peers) if peers else None
        for r in group:
            t = r["call_s_median"]
            mfu = f"{flops / t / PEAK:.0%}" if flops else "-"
            vs = f"{t / best:.2f}x" if best else "-"
            out.append(
                f"| {key[0]} | {key[1]} | {r['implementation']} | {r['attention']} | "
                f"{t * 1e3:.1f} | {mfu} | {vs} | {r['compile_s']:.0f} |"
            )
    return out


def shards(recs) -> list[str]:
    """Per-device program of an N-way step against the single program (N = 1, the same
    attention kernel) of the same call where it ran there, else of the first call that ran it
    (named beside the ratio)."""
    rows = [r for r in recs if r["part"].startswith("shards") and r.get("status") == "ok"]
    out = [
        "One device's program of an N-way step (collectives stood in by local copies): "
        "ms per denoiser call, and N x that / the single program's (1.00 = no loss):",
        "",
        "| model | px | attention | strategy | N | ms per call | N x per-device / single | call |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def kernel(r):
        scanned = ", scanned" if r.get("scan_blocks") else ""
        if "attention" in r:
            return f"{r['attention']} {r['block_q']}x{r['block_kv']}{scanned}"
        return _auto_then(r.get("git_commit"))

    single = {}  # (model, res, kernel) -> {part: seconds}
    for r in rows:
        if r["patches"] == 1:
            key = (r["model"], r["resolution"], kernel(r))
            single.setdefault(key, {})[r["part"]] = r["unet_call_s_median"]
    for r in sorted(
        rows, key=lambda r: (r["model"], str(r["resolution"]), kernel(r), r["patches"])
    ):
        ones = single.get((r["model"], r["resolution"], kernel(r)), {})
        part = r["part"] if r["part"] in ones else next(iter(ones), None)
        t = r["unet_call_s_median"]
        ratio = f"{r['patches'] * t / ones[part]:.2f}" if part else "-"
        if part and part != r["part"]:
            ratio += f" (single from `{part}/`)"
        strategy = r["strategy"].split("(")[0]
        if r.get("stale_exchange") == "left_out":  # the program beside its overlapped exchange
            strategy += ", stale exchange left out"
        out.append(
            f"| {r['model']} | {r['resolution']} | {kernel(r)} | {strategy} | {r['patches']} | "
            f"{t * 1e3:.1f} | {ratio} | `{r['part']}/` |"
        )
    return out


# The commit from which `auto` is `chunked` on a TPU (splash before it); shard records written
# before shard_timing.py recorded its kernel ran `auto` at their commit.
AUTO_CHUNKED = "a9f5735"


@functools.cache
def _auto_then(commit: str | None) -> str:
    """What `auto` resolved to on a TPU at `commit` (256x512 blocks either way)."""
    import subprocess

    if not commit:
        return "auto"
    try:
        code = subprocess.run(
            ["git", "merge-base", "--is-ancestor", AUTO_CHUNKED, commit],
            cwd=Path(__file__).parent, capture_output=True, check=False,
        ).returncode  # fmt: skip
    except OSError:
        return "auto"
    # 0: AUTO_CHUNKED is an ancestor, 1: it is not, else (a commit git does not know): unknown
    return {0: "chunked 256x512", 1: "splash 256x512"}.get(code, "auto")


if __name__ == "__main__":
    main()
