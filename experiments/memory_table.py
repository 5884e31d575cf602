"""Memory per device of SDXL's denoising step, from compiled programs (abstract parameters: no
weights needed), at the papers' resolutions, per strategy, device count and attention kernel.

    .venv/bin/python experiments/memory_table.py                       # the whole grid
    .venv/bin/python experiments/memory_table.py --resolutions 1024 --attention chunked
    .venv/bin/python experiments/memory_table.py --fsdp on --resolutions 1024 3840 \
        --strategies sync_patch distrifusion --attention chunked     # weights sharded (FSDP)

Each point compiles the steady-step program of `patchpar comm` (the one holding the stale
buffers) on this CPU, in float32, and reports XLA's buffer assignment: arguments (weights,
latent, conditioning, stale buffers in), outputs, temporaries, aliased. The bfloat16 figure the
table quotes is derived from it: arguments and outputs halved (every one is a bf16 tensor in a
bf16 run, bar a few scalars), temporaries kept as they are (an upper bound: no buffer is larger
in bf16, and the attention statistics stay float32 in both). Why not compile in bf16 here: the
CPU compiler has no bf16 matmuls, so it keeps a float32 copy of every weight as a temporary,
which no GPU or TPU program does. A GPU's own buffer assignment (fusions, cuDNN workspaces)
differs; experiments/device/attention_sdxl.py measures one there.

Records: <out>/records.jsonl (one per point; points already there are skipped: resumable);
table: <out>/table.md. Points are compiled one at a time (about 1-3 minutes each here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

STRATEGIES = ("single", "sync_patch", "distrifusion", "pcpp", "pipefusion")  # pipefusion: DiTs only
OTHERS = ("ring", "ulysses", "tensor")  # on request (--strategies): exact, no stale buffers
GIB = 2**30
H200_GB = 141e9  # one H200's HBM (bytes, decimal as NVIDIA quotes it)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="sdxl")
    p.add_argument("--resolutions", type=int, nargs="+", default=[3840, 1024, 2048])
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--attention", nargs="+", default=["chunked", "xla"])
    p.add_argument("--out", type=Path, default=Path("runs/memory"))
    p.add_argument(
        "--fsdp",
        choices=("off", "on", "both"),
        default="off",
        help="parallel points with the weights sharded over the devices, gathered per layer",
    )
    a = p.parse_args(argv)
    bad = [s for s in a.strategies if s not in STRATEGIES + OTHERS]
    if bad:
        p.error(f"--strategies {bad}: known {list(STRATEGIES + OTHERS)}")
    return a


def points(a) -> list[dict]:
    """chunked first (the targets), largest resolution first."""
    out = []
    for attention in a.attention:
        for res in a.resolutions:
            for strategy in a.strategies:
                for n in a.devices:
                    if (strategy == "single") != (n == 1):
                        continue
                    for fsdp in {"off": [False], "on": [True], "both": [False, True]}[a.fsdp]:
                        if fsdp and n == 1:
                            continue
                        out.append(
                            dict(
                                attention=attention,
                                resolution=res,
                                strategy=strategy,
                                devices=n,
                                fsdp=fsdp,
                            )  # fmt: skip
                        )
    return out


def key(p: dict) -> str:
    names = ("model", "attention", "resolution", "strategy", "devices")
    return json.dumps({**{k: p[k] for k in names}, "fsdp": p.get("fsdp", False)}, sort_keys=True)


def bf16_estimate(m: dict) -> int:
    return (m["arguments"] + m["outputs"] - m["aliased"]) // 2 + m["temporaries"]


def main(argv=None) -> None:
    a = parse(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from patchpar.lab.launch import request_cpu_devices

    request_cpu_devices(max(a.devices), print)
    from patchpar.lab.costs import CommConfig, run_comm
    from patchpar.lab.results import append_record, provenance, read_records

    path = a.out / "records.jsonl"
    done = {key(r) for r in (read_records(path) if path.is_file() else [])}
    todo = [p for p in points(a) if key({**p, "model": a.model}) not in done]
    print(f"{len(todo)} point(s) to compile ({len(done)} already in {path})", flush=True)
    import jax.numpy as jnp

    from patchpar.models.presets import abstract_denoiser
    from patchpar.parallel.rules import weight_bytes_per_device

    model = abstract_denoiser(a.model, jnp.float32)
    whole_weights = weight_bytes_per_device(model.abstract_params(), {}, {}, model.logical)
    for i, p in enumerate(todo):
        t0 = time.perf_counter()
        cfg = CommConfig.from_flags(
            model=a.model, resolution=p["resolution"], strategy=p["strategy"],
            devices=p["devices"], dtype="float32", attention=p["attention"], memory=True,
            fsdp=p["fsdp"],
        )  # fmt: skip
        rec = run_comm(cfg)
        m = rec["memory_per_device"]
        row = {
            "model": a.model, **p, "dtype_compiled": "float32",
            "float32_bytes": m, "bf16_estimate_bytes": bf16_estimate(m),
            "stale_bytes_per_device_fp32": rec["stale_bytes_per_device"],
            "steady_bytes_per_device_fp32": rec["steady_bytes_per_device"],
            "fsdp_bytes_per_device_fp32": rec["steady_by_site"].get("fsdp", {}).get("max", 0),
            "weight_bytes_per_device_fp32": rec["weight_bytes_per_device"],
            "weight_bytes_whole_fp32": whole_weights,
            "weight_rules": rec["weight_rules"],
            "memory_backend": rec["memory_backend"],
            "seconds": round(time.perf_counter() - t0, 1),
            "command": "python experiments/memory_table.py", **provenance(),
        }  # fmt: skip
        append_record(path, row)
        print(
            f"[{i + 1}/{len(todo)}] {p['attention']:8s} {p['resolution']}px {p['strategy']:12s} "
            f"{p['devices']} dev{' fsdp' * p['fsdp']}: bf16 {row['bf16_estimate_bytes'] / GIB:8.2f} GiB "
            f"(fp32 temporaries {m['temporaries'] / GIB:.2f} GiB) in {row['seconds']} s",
            flush=True,
        )
    write_table(read_records(path), a.out / "table.md")


def write_table(records: list[dict], out: Path) -> None:
    """Per resolution and kernel: GiB per device, bf16 estimate, per strategy x devices."""
    latest = {key(r): r for r in records}
    model = records[-1]["model"]
    shown = [s for s in STRATEGIES[1:] + OTHERS if any(r["strategy"] == s for r in records)]
    cols = [("single", 1)] + [(s, n) for s in shown for n in (2, 4, 8)]
    lines = [
        f"Memory per device, {model} denoising step (one image: its guidance halves), bf16 "
        "estimate in GiB from the compiled float32 program (experiments/memory_table.py). "
        "`-`: not compiled.",
        "",
        "| resolution | attention | " + " | ".join(f"{s} {n}" for s, n in cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for res in sorted({r["resolution"] for r in records}):
        for att in ("chunked", "xla"):
            cells = []
            for s, n in cols:
                r = latest.get(
                    key(dict(model=model, attention=att, resolution=res, strategy=s, devices=n))
                )
                cells.append("-" if r is None else f"{r['bf16_estimate_bytes'] / GIB:.2f}")
            if any(c != "-" for c in cells):
                lines.append(f"| {res} | {att} | " + " | ".join(cells) + " |")
    lines += fsdp_table(records, latest, model)
    commits = sorted({str(r.get("git_commit")) for r in records})
    lines += ["", f"Commits: {', '.join(commits)}. One H200 holds 141 GB = 131.3 GiB."]
    out.write_text("\n".join(lines) + "\n")


def fsdp_table(records: list[dict], latest: dict, model: str) -> list[str]:
    """Each FSDP point beside the same point with whole weights: weights per device, the
    per-layer gathers' bytes per UNet call and the memory per device (bf16, GiB)."""
    rows = sorted(
        (r for r in latest.values() if r.get("fsdp")),
        key=lambda r: (r["attention"], r["resolution"], r["strategy"], r["devices"]),
    )
    if not rows:
        return []
    lines = [
        "",
        "With the weights sharded over the devices and gathered per layer (`--fsdp`): bf16 GiB "
        "per device (weights and gathers: the float32 program's bytes / 2, exact since every "
        "weight is bf16 in a bf16 run).",
        "",
        "| resolution | attention | strategy | devices | weights (whole -> sharded) | weight "
        "gathers per UNet call | memory per device (whole -> fsdp) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        whole = latest.get(key({**r, "fsdp": False}))
        w = r["weight_bytes_per_device_fp32"] / 2 / GIB
        w0 = f"{r['weight_bytes_whole_fp32'] / 2 / GIB:.2f}"
        m0 = f"{whole['bf16_estimate_bytes'] / GIB:.2f}" if whole else "-"
        lines.append(
            f"| {r['resolution']} | {r['attention']} | {r['strategy']} | {r['devices']} | "
            f"{w0} -> {w:.2f} | {r['fsdp_bytes_per_device_fp32'] / 2 / GIB:.2f} | "
            f"{m0} -> {r['bf16_estimate_bytes'] / GIB:.2f} |"
        )
    return lines


if __name__ == "__main__":
    main()
