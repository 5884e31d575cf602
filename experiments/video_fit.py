"""What of a stale strategy fits one 16 GB chip on video: the stale buffers and the weights per
device of DistriFusion and PCPP on Wan 2.1 1.3B (480 x 832 x 81) and Wan 2.2 TI2V-5B (704 x 1280
x 121, its own size), on 2 and 8 patch devices, with the CFG halves on every device or split
over two device halves (cfg=2, DistriFusion §4.3), with the weights whole or sharded at rest
(FSDP), lowered with abstract bf16 weights (no compile: the buffers' and weights' bytes, a floor
under the program's memory, which adds XLA's temporaries).

    XLA_FLAGS=--xla_force_host_platform_device_count=16 .venv/bin/python experiments/video_fit.py \
        --out results/video_fit

Writes <out>/records.jsonl (resumable: points already recorded are skipped) and <out>/table.md,
each point beside what a TPU v5e chip offers (about 15.7 GiB).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

CHIP_GIB = 15.7  # a TPU v5e chip: 16 GiB of HBM, of which JAX offers about 15.7
MODELS = {"wan2.1-1.3b": (480, 832, 81), "wan2.2-5b": (704, 1280, 121)}
MESHES = ((2, 1), (4, 2), (8, 1), (16, 2))  # (devices, cfg): patch = devices / cfg
STRATEGIES = (("distrifusion", {}), ("pcpp", {"portion": 0.3, "send": "band"}))
GIB = 2**30


def points():
    return [(m, n, cfg, fsdp, s, o) for m in MODELS for n, cfg in MESHES
            for fsdp in (False, True) for s, o in STRATEGIES]  # fmt: skip


def key(r: dict) -> tuple:
    return (r["model"], r["devices"], r["cfg"], r["fsdp"], r["strategy"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/video_fit"))
    a = ap.parse_args(argv)
    runs = a.out / "records.jsonl"
    run(runs)
    from patchpar.lab.results import read_records

    write_table(read_records(runs, skip_bad=True), a.out / "table.md")
    return 0


def run(runs: Path) -> None:
    import jax.numpy as jnp
    from tqdm import tqdm

    from patchpar.lab.checks import check_video
    from patchpar.lab.results import append_record, provenance, read_records
    from patchpar.measure.cost import measure
    from patchpar.models.attention import AttentionSpec, resolve
    from patchpar.models.presets import abstract_denoiser, latent_factor
    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy

    done = {key(r) for r in read_records(runs, skip_bad=True)}
    prov, spec, models = provenance(), resolve(AttentionSpec(), jnp.bfloat16), {}
    for model, n, cfg, fsdp, name, opts in tqdm(points(), desc="video fit", unit="point"):
        strategy = make_strategy(name, **opts)
        h, w, frames = MODELS[model]
        point = {"model": model, "size": [h, w, frames], "devices": n, "cfg": cfg, "fsdp": fsdp,
                 "strategy": strategy.describe()}  # fmt: skip
        if key(point) in done:
            continue
        unet = models.setdefault(model, abstract_denoiser(model, jnp.bfloat16, spec))
        f = latent_factor(model)
        plan = Plan(strategy, n, cfg, fsdp=fsdp)
        t0 = time.perf_counter()
        try:
            at, hw = check_video(model, unet, (h // f, w // f), frames, "frames", plan)
            r = measure(at, plan, hw, batch=1, params=unet.abstract_params(), flops=False)
            stale, weights = r["stale_bytes_per_device"], r["weight_bytes_per_device"]
            status = {"status": "ok", "stale_bytes_per_device": stale,
                      "weight_bytes_per_device": weights,
                      "floor_gib": (stale + weights) / GIB}  # fmt: skip
        except Exception as e:  # a failed point is a row with its error, and the sweep goes on
            status = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        append_record(runs, {**point, "experiment": "video_fit", "dtype": "bfloat16", **status,
                             "seconds": round(time.perf_counter() - t0, 1),
                             "provenance": prov})  # fmt: skip


def write_table(records: list[dict], path: Path) -> None:
    lines = [
        "Stale buffers + weights per device (GiB), bfloat16, one model call (both CFG halves on "
        f"every device where cfg = 1), against a TPU v5e chip's {CHIP_GIB} GiB: a floor under "
        "the program's memory (XLA's temporaries come on top)",
        "",
        "| model | size | devices (cfg x patch) | weights | strategy | stale GiB | weights GiB | "
        "floor GiB | left for temporaries GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        h, w, frames = r["size"]
        mesh = f"{r['devices']} ({r['cfg']} x {r['devices'] // r['cfg']})"
        name = r["strategy"].split("(")[0] + (" band" if "band" in r["strategy"] else "")
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {h}x{w}x{frames} | {mesh} | "
                         f"{'FSDP' if r['fsdp'] else 'whole'} | {name} | {r['error'][:80]} ||||")  # fmt: skip
            continue
        floor = r["floor_gib"]
        lines.append(
            f"| {r['model']} | {h}x{w}x{frames} | {mesh} | {'FSDP' if r['fsdp'] else 'whole'} | "
            f"{name} | {r['stale_bytes_per_device'] / GIB:.2f} | "
            f"{r['weight_bytes_per_device'] / GIB:.2f} | {floor:.2f} | "
            f"{CHIP_GIB - floor:.2f}{'' if floor < CHIP_GIB else ' (does not fit)'} |"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
